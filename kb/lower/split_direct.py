"""A split-KV program run with one split needs no combine: its one partial is the output.

A split-KV program writes per-split partials (o_part, lse_part) that a last kernel merges (`combine`). With
NUM_SPLITS == 1 that merge is a copy: one partial of weight exp(lse - lse) = 1, so o = o_part[:, 0] and lse =
lse_part[:, 0] bit for bit (a split without keys: o_part = 0 and lse_part = -inf, which the combine also returns).
The Triton lowering then compiles the split kernel's partial stores as stores of the outputs (a `ONE_SPLIT`
constexpr) and the host skips the combine's launch: one kernel and a round trip of the partials fewer, which is a
visible share of a short decode (a windowed decode reads a few KV blocks per program). `direct_outputs` says when
this holds: the combine kernel only loads the partials, combines them and stores the result, and each partial is
its output with the split axis inserted, read whole along that axis and written at one split index.
"""

from __future__ import annotations

from dataclasses import dataclass

from kb.ir.expr import Expr, free_vars
from kb.ir.nodes import Combine, Full, Kernel, Let, Load, Program, Role, Store, walk_stmts

__all__ = ["SplitDirect", "direct_outputs", "split_kernels"]


@dataclass(frozen=True)
class SplitDirect:
    """The combine kernel a one-split launch skips, and each partial's output and split axis."""

    combine: str
    outputs: dict[str, tuple[str, int]]  # partial -> (output, split axis)

    def direct_store(self, st: Store) -> Store | None:
        """Store `st` of a partial as the store of its output (the split index dropped), else None."""
        if st.tensor not in self.outputs or st.accumulate:
            return None
        out, axis = self.outputs[st.tensor]
        return Store(out, st.index[:axis] + st.index[axis + 1:], st.value)


def split_kernels(p: Program) -> list[Kernel]:
    """The kernels with a split-KV grid axis (an extent over NUM_SPLITS)."""
    return [k for k in p.kernels if any("NUM_SPLITS" in free_vars(a.extent) for a in k.grid)]


def direct_outputs(p: Program) -> SplitDirect | None:
    """What a one-split launch of `p` stores directly and which kernel it skips; None when `p` is not a split-KV
    program ending in a plain combine (see the module docstring)."""
    split = split_kernels(p)
    rest = [k for k in p.kernels if k not in split]
    if not split or len(rest) != 1:
        return None
    body = rest[0].body
    loads = {st.out: st for st in body if isinstance(st, Load)}
    stores = [st for st in body if isinstance(st, Store)]
    combines = [st for st in body if isinstance(st, Combine)]
    if len(combines) != 1 or len(stores) != 2 or not all(isinstance(st, (Let, Load, Store, Combine)) for st in body):
        return None
    c = combines[0]
    outputs: dict[str, tuple[str, int]] = {}
    for part, result in ((c.o_parts, c.o), (c.lse_parts, c.lse)):
        ld, written = loads.get(part), [st for st in stores if st.value == result and not st.accumulate]
        if ld is None or len(written) != 1:
            return None
        scratch, target = p.param(ld.tensor), p.param(written[0].tensor)
        if scratch.role is not Role.SCRATCH or "NUM_SPLITS" not in scratch.shape:
            return None
        axis = scratch.shape.index("NUM_SPLITS")
        if scratch.shape[:axis] + scratch.shape[axis + 1:] != target.shape or not isinstance(ld.index[axis], Full) \
                or ld.index[:axis] + ld.index[axis + 1:] != written[0].index:
            return None
        outputs[ld.tensor] = (target.name, axis)
    for k in split:
        for st in walk_stmts(k.body):
            if isinstance(st, Store) and st.tensor in outputs \
                    and (st.accumulate or not isinstance(st.index[outputs[st.tensor][1]], Expr)):
                return None  # a partial added to, or written over a range of splits: not one split's point
            if isinstance(st, Store) and st.tensor in {o for o, _ in outputs.values()}:
                return None  # the split kernel writes the output itself
    return SplitDirect(rest[0].name, outputs)
