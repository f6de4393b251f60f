"""Build a lowered CUDA program into a shared library and run it on torch CUDA tensors.

`CudaKernel.from_program(p)` lowers `p` (`kb.lower.cuda`), compiles it with nvcc into
`<cache_dir>/<program>_<sha12>.so` (`kb.lower.cuda_build`, cached by content) for the GPU's
own arch, and loads it with ctypes. `run(inputs)` has the Triton runtime's interface: inputs,
aux tensors and scalars by param name (sm_scale optional, default 1/sqrt(D)); it returns the
outputs by name, o [B, Hq, M, D] in q's dtype and lse [B, Hq, M] fp32 (natural log), fully
masked rows giving o = 0 and lse = -inf.

Invariants: on a machine without a CUDA device every entry point raises
KBError("CUDA kernels need a GPU ...") before touching nvcc; the launch runs on torch's current
stream, so torch ordering and events apply; dims are bound from the tensors' shapes and every
occurrence of a dim must agree; tensors may be non-contiguous (strides are passed).
"""

from __future__ import annotations

import ctypes
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from kb.errors import KBError
from kb.ir.nodes import Dtype, Param, Program, Role
from kb.lower.cuda import ERROR_SYMBOL, LAUNCH_SYMBOL, LaunchAbi, launch_abi, lower_program, source_schedule
from kb.lower.cuda_build import BuildMode, build
from kb.lower.cuda_mma import lower_program_mma
from kb.lower.cuda_sm90_ir import abi_program
from kb.settings import load_settings

__all__ = ["CudaKernel", "require_gpu", "device_arch"]

log = logging.getLogger(__name__)

_TORCH = {Dtype.F32: torch.float32, Dtype.BF16: torch.bfloat16, Dtype.F16: torch.float16,
          Dtype.I32: torch.int32, Dtype.I64: torch.int64, Dtype.BOOL: torch.bool}


def require_gpu() -> None:
    if not torch.cuda.is_available():
        raise KBError("CUDA kernels need a GPU: no CUDA device is visible to torch here; "
                      "run on a GPU machine, or check the generated source with kb.lower.cuda_build (compile only)")


def device_arch(device: int | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    suffix = "a" if (major, minor) == (9, 0) else ""  # sm_90a enables Hopper-only instructions; harmless here
    return f"sm_{major}{minor}{suffix}"


def _default_cache_dir() -> Path:
    try:
        return load_settings().cache_dir / "cuda"
    except Exception:  # settings that do not load: a temp dir always works
        return Path(tempfile.gettempdir()) / "kernel-kb-cuda"


@dataclass(frozen=True)
class CudaKernel:
    """A Program lowered to CUDA, built and loaded; `run` launches it."""

    program: Program
    source: str
    library: Path
    abi: LaunchAbi
    lib: ctypes.CDLL

    @classmethod
    def from_program(cls, p: Program, cache_dir: Path | None = None, arch: str | None = None, *,
                     tensor_cores: bool = False, defines: tuple[str, ...] = ()) -> "CudaKernel":
        """Lower `p` (`tensor_cores`: kb.lower.cuda_mma with p's schedule as the traits), build and load it."""
        require_gpu()
        return cls.from_source(p, lower_program_mma(p) if tensor_cores else lower_program(p), cache_dir, arch,
                               defines=defines)

    @classmethod
    def from_source(cls, p: Program, source: str, cache_dir: Path | None = None, arch: str | None = None, *,
                    defines: tuple[str, ...] = ()) -> "CudaKernel":
        """Build and load a lowered source of `p` as it is (say, the `.cu` that `kb generate` wrote): its
        BLOCK_M/BLOCK_N/warps, read from the source, size the block-class table; its dtypes are those the source
        computes in (kb.lower.cuda_sm90_ir.abi_program)."""
        require_gpu()
        p = source_schedule(abi_program(p, source), source)
        result = build(source, cache_dir or _default_cache_dir(), BuildMode.SHARED, name=p.name,
                       arch=arch or device_arch(), defines=defines)
        if not result.ok:
            raise KBError(f"nvcc could not build program {p.name} ({result.status.value}):\n{result.log[-4000:]}")
        lib = ctypes.CDLL(str(result.artefact))
        launch = getattr(lib, LAUNCH_SYMBOL)
        launch.restype = ctypes.c_int
        launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong),
                           ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_double), ctypes.c_void_p]
        getattr(lib, ERROR_SYMBOL).restype = ctypes.c_char_p
        return cls(p, source, result.artefact, launch_abi(p), lib)  # type: ignore[arg-type]

    def run(self, inputs: Mapping[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
        """Launch on `inputs`; returns the program's OUT params by name."""
        p, abi = self.program, self.abi
        tensors = self._bind_inputs(inputs)
        dims = self._dims(tensors)
        device = tensors["q"].device
        for t in abi.tensors:
            if t.role in (Role.OUT, Role.SCRATCH):
                tensors[t.name] = torch.empty(_shape(t, dims), dtype=_TORCH[t.dtype], device=device)
        scalars = []
        for name in abi.scalars:
            value = inputs.get(name)
            if value is None and name == "sm_scale":
                value = 1.0 / math.sqrt(dims["D"]) if "D" in dims else None
            if value is None:
                raise KBError(f"program {p.name} needs the scalar {name}=...")
            scalars.append(float(value))
        order = [tensors[t.name] for t in abi.tensors]
        if abi.table:
            order.append(torch.empty(abi.table.shape(dims), dtype=torch.int8, device=device))
        ptrs = (ctypes.c_void_p * len(order))(*(t.data_ptr() for t in order))
        strides_list = [s for t in abi.tensors for s in tensors[t.name].stride()]
        strides = (ctypes.c_longlong * max(1, len(strides_list)))(*strides_list)
        dim_arr = (ctypes.c_longlong * max(1, len(abi.dims)))(*(dims[d] for d in abi.dims))
        scalar_arr = (ctypes.c_double * max(1, len(scalars)))(*scalars)
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device).cuda_stream
            rc = self.lib.kb_launch(ptrs, strides, dim_arr, scalar_arr, ctypes.c_void_p(stream))
        if rc != 0:
            msg = self.lib.kb_error_string(rc).decode(errors="replace")
            raise KBError(f"CUDA launch of program {p.name} failed: {msg} (code {rc})")
        return {t.name: tensors[t.name] for t in abi.tensors if t.role is Role.OUT}

    # -- helpers
    def _bind_inputs(self, inputs: Mapping[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
        p = self.program
        need = [t for t in self.abi.tensors if t.role in (Role.IN, Role.AUX)]
        missing = [t.name for t in need if t.name not in inputs]
        if missing:
            raise KBError(f"program {p.name} needs tensors {missing}; got {sorted(inputs)}")
        unknown = sorted(set(inputs) - {t.name for t in need} - set(self.abi.scalars))
        if unknown:
            raise KBError(f"program {p.name} got unexpected arguments {unknown}")
        out: dict[str, torch.Tensor] = {}
        for t in need:
            x = inputs[t.name]
            if not isinstance(x, torch.Tensor) or not x.is_cuda:
                raise KBError(f"{t.name} must be a CUDA tensor for the CUDA runtime")
            if x.dtype != _TORCH[t.dtype]:
                raise KBError(f"{t.name} must be {t.dtype.value} ({_TORCH[t.dtype]}), got {x.dtype}")
            out[t.name] = x
        return out

    def _dims(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
        s = self.program.schedule
        dims: dict[str, int] = s.tile_constants()
        for t in self.abi.tensors:
            if t.name not in tensors:
                continue
            x = tensors[t.name]
            if x.dim() != len(t.shape):
                raise KBError(f"{t.name}: expected {len(t.shape)} dims {list(t.shape)}, got shape {tuple(x.shape)}")
            for d, n in zip(t.shape, x.shape):
                want = d if isinstance(d, int) else dims.setdefault(str(d), n)
                if want != n:
                    raise KBError(f"{t.name}: dim {d} is {n} here but {want} elsewhere")
        unbound = [d for d in self.abi.dims if d not in dims]
        if unbound:
            raise KBError(f"program {self.program.name}: dims {unbound} are carried by no input tensor")
        return dims


def _shape(t: Param, dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else dims[str(d)] for d in t.shape)
