"""The CUDA dispatch of a generated forward module, as a module of its own.

When `kb generate` finds measurements saying that the `.cu` it writes beside the Triton module runs faster on some GPU
arch and head-dim bucket (generate.cuda_design.forward_dispatch), the module gets the text between the marker lines
below (kb.lower.triton pastes it byte for byte; kept here it is linted and tested like other code), plus four constants:
`CUDA_SOURCE` (the `.cu` file's name, beside the module), `CUDA_ARCH` (the arch it was written for: `sm_90a` builds for
that GPU only, a family arch such as `sm_80` for any GPU at least that new, as this GPU's own arch), `CUDA_FORWARD`
({arch: {head-dim bucket: the measurement that chose it}}), `CUDA_BACKWARD` (the same for the `.cu`'s Hopper backward,
kb.lower.cuda_sm90_bwd; empty where the `.cu` has none), `CUDA_BWD_PAD_Q` (its scratch rows are padded to a multiple of
it) and `_CUDA_ABI` (kb.lower.cuda's `kb_launch` argument order).

`_cuda_backward(q, k, v, o, dout, lse, sm_scale, named)` returns (dq, dk, dv) from the `.cu`'s backward the same way, and
None wherever backward()'s Triton kernels should run.
`_cuda_forward(q, k, v, sm_scale, named)` returns the program's outputs (o, lse) from the `.cu` where CUDA_FORWARD lists the GPU's arch and
q's head-dim bucket, and None everywhere else, so that the caller runs the Triton kernels: CPU tensors, another arch or
head dim, inputs of another dtype than the `.cu` was written for, layouts the `.cu` refuses (TMA needs 16-byte aligned
strides and a unit last stride), and inputs the `.cu`'s own launch checks refuse (another head dim in the bucket).
The first call per device and bucket builds the `.cu` with nvcc (`$KB_NVCC`,
`$CUDA_HOME/bin/nvcc`, `nvcc` on PATH or /usr/local/cuda) into `$KB_CACHE_DIR/cuda` (default
`~/.cache/kernel-kb/cuda`); the library's name carries the sha256 of the source and the flags, so a cached build is
never stale, and nvcc writes a temporary file that is renamed into place. When the `.cu` cannot be built here (no nvcc,
no source file, an nvcc error) the module logs one warning saying why and runs the Triton kernels from then on; a launch
that fails on the GPU raises. The build itself is kb.lower.nvcc_preamble's, pasted before this text.
"""

import logging
import math
import os

import torch
import triton

from kb.lower.nvcc_preamble import _cuda_build, _CudaUnavailable

# ---- generated modules: preamble begins (cuda dispatch; pasted byte for byte; edit only between these lines) ----
import ctypes

_CUDA_LIBS = {}  # (device index, head-dim bucket) -> the loaded library, or None: the Triton kernels run there
_CUDA_REFUSED = set()  # why the `.cu` refused inputs, each reported once
_CUDA_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32,
                "i64": torch.int64, "bool": torch.bool}


def _cuda_build_arch(major, minor):
    """What nvcc builds the `.cu` for on a GPU of compute capability major.minor; None when it cannot run there."""
    own = f"sm_{major}{minor}"
    if CUDA_ARCH.endswith("a"):
        return CUDA_ARCH if CUDA_ARCH[:-1] == own else None
    return own if (major, minor) >= divmod(int(CUDA_ARCH[3:]), 10) else None


def _cuda_library(device, bucket):
    """The `.cu` built for this bucket and loaded, once per device and bucket; None (after one warning) when it cannot be."""
    key = (device.index, bucket)
    if key not in _CUDA_LIBS:
        _CUDA_LIBS[key] = None
        try:
            path = _cuda_build(os.path.join(os.path.dirname(os.path.abspath(__file__)), CUDA_SOURCE),
                               _cuda_build_arch(*torch.cuda.get_device_capability(device)), (f"KB_HEAD_PAD_ONLY={bucket}",))
            lib = ctypes.CDLL(path)
            lib.kb_launch.restype = ctypes.c_int
            lib.kb_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong),
                                      ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_double),
                                      ctypes.c_void_p]
            lib.kb_error_string.restype = ctypes.c_char_p
            bwd = getattr(lib, "kb_launch_bwd", None)  # the Hopper backward, where the `.cu` holds one
            if bwd is not None:
                bwd.restype = ctypes.c_int
                bwd.argtypes = [*lib.kb_launch.argtypes[:4], ctypes.POINTER(ctypes.c_void_p),
                                ctypes.POINTER(ctypes.c_longlong), ctypes.c_int, ctypes.c_void_p]
            _CUDA_LIBS[key] = lib
        except (_CudaUnavailable, OSError) as err:
            _log.warning("%s: running the Triton kernels instead of %s: %s", PROGRAM, CUDA_SOURCE, err)
    return _CUDA_LIBS[key]


def _cuda_layout_ok(t):
    """TMA's rules, which the `.cu` checks before it launches: unit last stride, 16-byte aligned base and strides."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1])


def _cuda_ready(q, k, v, named, listed):
    """(library, tensors by name, dims) where `listed` ({arch: {bucket: why}}) names this GPU and q's head-dim bucket
    and the inputs suit the `.cu`; None: run the Triton kernels."""
    if not q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    major, minor = torch.cuda.get_device_capability(q.device)
    bucket = max(16, triton.next_power_of_2(q.shape[-1]))
    if bucket not in listed.get(f"sm{major}{minor}", {}) or _cuda_build_arch(major, minor) is None:
        return None
    tensors = {"q": q, "k": k, "v": v, **{n: x for n, x in named.items() if isinstance(x, torch.Tensor)}}
    dims = dict(_CUDA_ABI["constants"])
    for name, role, shape, dtype in _CUDA_ABI["tensors"]:
        if role not in ("in", "aux"):
            continue
        t = tensors.get(name)
        if t is None or t.dtype != _CUDA_DTYPES[dtype] or t.dim() != len(shape) or not t.is_cuda:
            return None
        for d, n in zip(shape, t.shape):
            want = dims.setdefault(d, n) if isinstance(d, str) else d
            if want != n:
                return None
    if not all(_cuda_layout_ok(tensors[n]) for n in ("q", "k", "v")):
        return None
    lib = _cuda_library(q.device, bucket)
    return None if lib is None else (lib, tensors, dims)


def _cuda_args(q, tensors, dims, sm_scale, named):
    """kb_launch's pointers, strides, dims and scalars for `tensors` (every tensor of the ABI, by name)."""
    order = [tensors[t[0]] for t in _CUDA_ABI["tensors"]]
    table = _CUDA_ABI["table"]
    if table is not None:
        per_b, per_h, b, h, m, n, block_m, block_n = table
        order.append(torch.empty((dims[b] if per_b else 1, dims[h] if per_h else 1, -(-dims[m] // block_m),
                                  -(-dims[n] // block_n)), dtype=torch.int8, device=q.device))
    scalars = [1.0 / math.sqrt(q.shape[-1]) if s == "sm_scale" and sm_scale is None else
               float(sm_scale if s == "sm_scale" else named[s]) for s in _CUDA_ABI["scalars"]]
    strides = [s for t in order[:len(_CUDA_ABI["tensors"])] for s in t.stride()]
    return ((ctypes.c_void_p * len(order))(*(t.data_ptr() for t in order)),
            (ctypes.c_longlong * max(1, len(strides)))(*strides),
            (ctypes.c_longlong * max(1, len(_CUDA_ABI["dims"])))(*(dims[d] for d in _CUDA_ABI["dims"])),
            (ctypes.c_double * max(1, len(scalars)))(*scalars), order)


def _cuda_forward(q, k, v, sm_scale, named):
    """The outputs (o, lse) from the `.cu` where CUDA_FORWARD lists this GPU and q's head-dim bucket; None: run the Triton kernels."""
    ready = _cuda_ready(q, k, v, named, CUDA_FORWARD)
    if ready is None:
        return None
    lib, tensors, dims = ready
    for name, role, shape, dtype in _CUDA_ABI["tensors"]:
        if role in ("out", "scratch"):
            size = tuple(d if isinstance(d, int) else dims[d] for d in shape)
            tensors[name] = torch.empty(size, dtype=_CUDA_DTYPES[dtype], device=q.device)
    *args, _keep = _cuda_args(q, tensors, dims, sm_scale, named)
    with torch.cuda.device(q.device):
        rc = lib.kb_launch(*args, ctypes.c_void_p(torch.cuda.current_stream(q.device).cuda_stream))
    if not _cuda_launched(lib, rc):
        return None
    return tuple(tensors[name] for name, role, _, _ in _CUDA_ABI["tensors"] if role == "out")


def _cuda_backward(q, k, v, o, dout, lse, sm_scale, named):
    """(dq, dk, dv) from the `.cu`'s Hopper backward (`kb_launch_bwd`, kb.lower.cuda_sm90_bwd) where CUDA_BACKWARD lists
    this GPU and q's head-dim bucket; None: run backward()'s Triton kernels. o may be fp32 (the exact O) or q's type."""
    ready = _cuda_ready(q, k, v, named, CUDA_BACKWARD)
    if ready is None or o.shape != q.shape or dout.shape != q.shape or lse.shape != q.shape[:3] or \
            o.dtype not in (q.dtype, torch.float32) or dout.dtype != q.dtype or lse.dtype != torch.float32 or \
            not _cuda_layout_ok(dout) or v.shape[-1] != q.shape[-1]:
        return None
    lib, tensors, dims = ready
    if getattr(lib, "kb_launch_bwd", None) is None:
        return None
    tensors["o"], tensors["lse"] = o, lse  # kb_launch's o and lse slots: the backward reads lse there
    B, Hq, M, D = q.shape
    m_pad = -(-M // CUDA_BWD_PAD_Q) * CUDA_BWD_PAD_Q
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=q.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    acc = torch.empty((B, Hq, m_pad, D), dtype=torch.float32, device=q.device)
    rows = torch.empty((2, B, Hq, m_pad), dtype=torch.float32, device=q.device)  # delta, lse * log2 e
    grads = (o, dout, dq, dk, dv, acc, rows[0], rows[1])
    *args, _keep = _cuda_args(q, tensors, dims, sm_scale, named)
    gstrides = [s for t in (o, dout, dq, dk, dv) for s in t.stride()]
    with torch.cuda.device(q.device):
        rc = lib.kb_launch_bwd(*args, (ctypes.c_void_p * 8)(*(t.data_ptr() for t in grads)),
                               (ctypes.c_longlong * 20)(*gstrides), int(o.dtype == torch.float32),
                               ctypes.c_void_p(torch.cuda.current_stream(q.device).cuda_stream))
    if not _cuda_launched(lib, rc):
        return None
    return dq, dk, dv


def _cuda_launched(lib, rc):
    """True when `kb_launch` ran; False when the `.cu`'s own checks refused these inputs before launching anything
    (codes below 0 and 10000-10999: a head dim it was not written for, a layout or range it cannot address), so that
    the Triton kernels run instead, with one warning per reason; a CUDA error raises."""
    if rc == 0:
        return True
    reason = lib.kb_error_string(rc).decode(errors="replace")
    if rc < 0 or 10000 <= rc < 11000:
        if reason not in _CUDA_REFUSED:
            _CUDA_REFUSED.add(reason)
            _log.warning("%s: %s refused these inputs (%s); running the Triton kernels", PROGRAM, CUDA_SOURCE, reason)
        return False
    raise RuntimeError(f"{PROGRAM}: the CUDA launch of {CUDA_SOURCE} failed: {reason} (code {rc})")
# ---- generated modules: preamble ends ----

# placeholders for the generated module's own constants (see the module docstring)
_log = logging.getLogger("kernel_kb.generated")
PROGRAM = "cuda_dispatch_preamble"
CUDA_SOURCE = "kernel.cu"
CUDA_ARCH = "sm_90a"
CUDA_FORWARD: dict = {}
CUDA_BACKWARD: dict = {}
CUDA_BWD_PAD_Q = 128
_CUDA_ABI: dict = {"tensors": (), "dims": (), "scalars": (), "table": None, "constants": {}}
