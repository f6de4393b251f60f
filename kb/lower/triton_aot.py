"""Compile a lowered program's Triton kernels for a CUDA arch without a GPU (ahead of time).

The Triton interpreter checks semantics on CPU but never runs Triton's GPU compiler, so code
that is valid Python yet fails to compile (a type error in the compiled dialect, shared memory
over the limit, a pass crash) would only surface on the GPU machine. `compile_for_arch` runs the
real compiler (`triton.compile` with a `GPUTarget`, Triton's bundled ptxas) on this machine, with
concrete constexprs taken from the program's schedule, and reports what the GPU would get.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

from kb.errors import KBError
from kb.ir.nodes import Dtype, Program, Role
from kb.lower.runtime import load_module
from kb.lower.triton import LowerOptions, kernel_fn_name, lower_program

__all__ = ["AotKernel", "compile_for_arch"]

_PTR = {Dtype.F32: "*fp32", Dtype.BF16: "*bf16", Dtype.F16: "*fp16", Dtype.I32: "*i32", Dtype.I64: "*i64", Dtype.BOOL: "*i1"}
_TABLE_PTRS = {"bc_ptr": "*i8", "kvl_ptr": "*i32"}


def _compiled_module(p: Program, options: LowerOptions | None) -> ModuleType:
    """The lowered module imported with TRITON_INTERPRET unset, so `@triton.jit` makes compilable functions."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return load_module(lower_program(p, options), p.name + "_aot")[0]
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


@dataclass(frozen=True)
class AotKernel:
    name: str
    shared_bytes: int
    wgmma: int  # wgmma.mma_async instructions in the PTX (Hopper tensor cores)
    tma_loads: int  # cp.async.bulk.tensor instructions (TMA copies)


def compile_for_arch(p: Program, *, arch: int = 90, head_dim: int = 128, tma: bool = True,
                     options: LowerOptions | None = None) -> list[AotKernel]:
    """Compile every kernel of `p` for sm_`arch` as the host would launch it at `head_dim` (USE_TMA=`tma`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = _compiled_module(p, options)
    tensors = {f"{q.name}_ptr": _PTR[q.dtype] for q in p.params if q.role is not Role.SCALAR}
    scalars = {q.name for q in p.params if q.role is Role.SCALAR}
    s = p.schedule
    head_pad = s.head_pad or max(16, triton.next_power_of_2(head_dim))
    consts = {"BLOCK_M": s.block_m, "BLOCK_N": s.block_n, "NUM_SPLITS": s.num_splits, "HEAD_PAD": head_pad,
              "EVEN_D": head_pad == head_dim, "USE_TMA": tma, "WARP_SPEC": tma and s.warp_specialize}
    out = []
    for k in p.kernels:
        fn = getattr(module, kernel_fn_name(k))
        sig: dict[str, str] = {}
        for name in fn.arg_names:
            if name in tensors or name in _TABLE_PTRS:
                sig[name] = tensors.get(name) or _TABLE_PTRS[name]
            elif name in consts or name.startswith(("POS_", "PAD_")):
                sig[name] = "constexpr"
            else:
                sig[name] = "fp32" if name in scalars else "i32"
        values = {n: consts.get(n, True if n.startswith("POS_") else 64) for n, t in sig.items() if t == "constexpr"}
        try:
            compiled = triton.compile(ASTSource(fn, sig, values), target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": s.num_warps, "num_stages": s.num_stages})
        except Exception as err:  # the compiler's own error, with the kernel named
            raise KBError(f"{p.name}/{k.name}: Triton does not compile it for sm_{arch}: {err}") from err
        ptx = compiled.asm["ptx"]
        out.append(AotKernel(k.name, compiled.metadata.shared, ptx.count("wgmma.mma_async"),
                             ptx.count("cp.async.bulk.tensor")))
    return out
