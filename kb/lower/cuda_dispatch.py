"""Where a generated forward module runs the `.cu` beside it instead of its Triton kernels, and the text that does it.

`CudaDispatch` is generation's decision (generate.cuda_design.forward_dispatch, from measured records): the `.cu` file's
name, the arch nvcc builds it for, and per GPU arch and head-dim bucket the measurement that chose the `.cu`.
`dispatch_section(p, source, d)` is what kb.lower.triton appends to the module's host code: the constants and the
runtime of kb.lower.nvcc_preamble and kb.lower.cuda_dispatch_preamble (build at first use, cached; launch through the
`kb_launch` ABI; the Triton kernels wherever the `.cu` is not listed or cannot run). A module without a dispatch has none of this text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kb.errors import KBError
from kb.ir.nodes import Program, Role
from kb.lower.cuda import launch_abi, source_schedule
from kb.lower.cuda_sm90_bwd import BWD_PAD_Q
from kb.lower.cuda_sm90_ir import abi_program
from kb.lower.preambles import preamble_text

__all__ = ["CudaDispatch", "dispatch_section"]


@dataclass(frozen=True)
class CudaDispatch:
    source_name: str  # the `.cu` file's name; it sits beside the module
    source: str = field(repr=False)  # its text (the tiles and launch order are read from it)
    arch: str  # nvcc's target, e.g. sm_90a
    forward: dict[str, dict[int, str]] = field(default_factory=dict)  # {sm90: {128: why}}: where the `.cu` runs
    backward: dict[str, dict[int, str]] = field(default_factory=dict)  # where its Hopper backward runs
    has_backward: bool = False  # the `.cu` holds the Hopper backward (`kb_launch_bwd`), listed in `backward` or not

    def __bool__(self) -> bool:
        return any(self.forward.values()) or self.has_backward


def _abi(p: Program, source: str) -> dict:
    """kb.lower.cuda's launch order for the `.cu` of `p` (its tiles read from the source, its dtypes those it
    computes in: `abi_program`) as plain data."""
    p = source_schedule(abi_program(p, source), source)
    abi = launch_abi(p)
    tensors = tuple((t.name, t.role.value, tuple(d if isinstance(d, int) else str(d) for d in t.shape), t.dtype.value)
                    for t in abi.tensors)
    if not any(t[0] == "o" and t[1] == Role.OUT.value for t in tensors):
        raise KBError(f"program {p.name}: the `.cu` writes no output o")
    table = None if abi.table is None else dataclasses.astuple(abi.table)
    constants = p.schedule.tile_constants()
    return {"tensors": tensors, "dims": abi.dims, "scalars": abi.scalars, "table": table, "constants": constants}


def dispatch_section(p: Program, source: str, d: CudaDispatch) -> list[str]:
    """The lines that let forward module `p` run the `.cu` (`source`) where `d` lists it; none when `d` lists nothing."""
    if not d:
        return []
    forward, backward = ({arch: dict(sorted(buckets.items())) for arch, buckets in sorted(table.items()) if buckets}
                         for table in (d.forward, d.backward))
    return ["", "", "# ---- CUDA: the `.cu` beside this module, run where kernel-kb measured it faster ----",
            f"CUDA_SOURCE = {d.source_name!r}  # beside this file",
            f"CUDA_ARCH = {d.arch!r}  # what nvcc builds it for",
            "# {GPU arch: {head-dim bucket: the measurement that chose the .cu}}; elsewhere the Triton kernels run",
            f"CUDA_FORWARD = {forward!r}",
            "# the same for the `.cu`'s Hopper backward (kb.lower.cuda_sm90_bwd); elsewhere backward()'s Triton kernels run",
            f"CUDA_BACKWARD = {backward!r}",
            f"CUDA_BWD_PAD_Q = {BWD_PAD_Q}  # the backward's scratch rows are padded to a multiple of it",
            f"_CUDA_ABI = {_abi(p, source)!r}  # kb_launch's argument order (kb.lower.cuda)",
            preamble_text("nvcc_preamble.py").rstrip(), "", "", preamble_text("cuda_dispatch_preamble.py").rstrip()]
