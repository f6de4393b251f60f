"""GQA packing: which kernels of a Program may run with the query heads of a KV head packed into tile rows.

Packed, a kernel over the grid (b, h: Hq, m: cdiv(M, BLOCK_M), ...) runs over (b, hk: Hkv, m: cdiv(G * M,
BLOCK_M), ...) with G = Hq // Hkv, and row r of its query tile is the pair (query head hk * G + r // M,
query position r % M) (FlashAttention-2's ngroups swap for decode, FA3's PackGQA, FlashInfer's decode).
Every KV tile a program loads then serves G query heads: K/V of a KV head are read once per split instead
of G times. The IR's meaning is unchanged; the lowering gathers q and scatters o / partials per row, and
mask_mod / score_mod see each row's own head and query position.

Packing a kernel is exact when every use of the head axis and of the query block is one the lowering
rewrites per row (checked here, statically):
- the head axis `h` appears only as `h // (Hq // Hkv)` (the KV head, the same for every row of a group), or
  as the head index of a tensor also indexed by the query-block span `m_start:+BLOCK_M` over M (gathered);
- the query block `m` appears only through `m_start = m * BLOCK_M`, as such a span or as the q_start of a
  mask / score_mod / block test: never in a KV loop bound (rows of one packed tile are different query
  positions, so bounds derived from the query block, as causal block skipping, would be wrong);
- block tests (`if block(...)`) only where the program has no mask_mod (their class then depends on the
  tile's extent alone; with a mask the class of a packed tile mixes query positions).
M > 1 (a few query tokens, speculative decoding) packs under the same rules. A refusal names the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from kb.ir.expr import Expr, ExprOp, call, free_vars, var
from kb.ir.nodes import For, Full, IfBlock, Kernel, Let, Load, Mask, Program, ScoreMod, Span, Store, serving_constructs, walk_stmts

__all__ = ["PackPlan", "pack_plans", "row_span", "PACK_ROWS"]

PACK_ROWS = "_PK_ROWS"  # the name a packed kernel gives G * M (its row count) in expressions


@dataclass(frozen=True)
class PackPlan:
    """One kernel's packing: its head axis, its query-block axis and the names holding the block start."""

    head: str  # grid axis over Hq
    rows: str  # grid axis over cdiv(M, BLOCK_M)
    starts: frozenset[str]  # lets equal to rows * BLOCK_M
    hq: str  # q's head dim name (Hq)
    hkv: str  # k's head dim name (Hkv)
    m: str  # q's query dim name (M)

    def group_head(self) -> Expr:
        """`h // (Hq // Hkv)`: the KV head, the only form in which the head axis may appear as a scalar."""
        return var(self.head) // (var(self.hq) // var(self.hkv))


    def extent(self, axis: str, e: Expr) -> Expr:
        """A grid axis extent of the packed kernel: Hkv heads, cdiv(G * M, BLOCK_M) query blocks."""
        if axis == self.head:
            return var(self.hkv)
        if axis == self.rows:
            return call("cdiv", var(PACK_ROWS), var("BLOCK_M"))
        return e


def pack_plans(p: Program) -> dict[str, PackPlan] | str:
    """{kernel name: plan} when every kernel of `p` packs, else the reason it does not (one line)."""
    if constructs := serving_constructs(p):
        return f"the program uses {' and '.join(constructs)} (varlen/paged forms do not pack)"
    try:
        q, k = p.param("q"), p.param("k")
    except KeyError:
        return "the program has no q / k params"
    if len(q.shape) != 4 or len(k.shape) != 4 or not all(isinstance(d, str) for d in (q.shape[1], q.shape[2], k.shape[1])):
        return "q / k are not [B, H, S, D] with symbolic heads and lengths"
    hq, m, hkv = str(q.shape[1]), str(q.shape[2]), str(k.shape[1])
    plans: dict[str, PackPlan] = {}
    for kern in p.kernels:
        plan = _kernel_plan(kern, hq, hkv, m)
        if isinstance(plan, str):
            return f"kernel {kern.name}: {plan}"
        why = _check_body(kern, plan, p, has_mask=p.mask_mod is not None)
        if why:
            return f"kernel {kern.name}: {why}"
        plans[kern.name] = plan
    return plans


def _kernel_plan(kern: Kernel, hq: str, hkv: str, m: str) -> PackPlan | str:
    heads = [a.name for a in kern.grid if a.extent == var(hq)]
    rows = [a.name for a in kern.grid if a.extent == call("cdiv", var(m), var("BLOCK_M"))]
    if len(heads) != 1 or len(rows) != 1:
        return f"its grid has no single axis over {hq} and over cdiv({m}, BLOCK_M)"
    starts = frozenset(st.name for st in walk_stmts(kern.body) if isinstance(st, Let)
                       and st.value in (var(rows[0]) * var("BLOCK_M"), var("BLOCK_M") * var(rows[0])))
    return PackPlan(heads[0], rows[0], starts, hq, hkv, m)


def _uses(e: Expr, plan: PackPlan) -> str | None:
    """What makes scalar `e` differ between the rows of a packed tile, or None when it does not."""
    if free_vars(e) & ({plan.rows} | plan.starts):
        return "the query block"
    group = plan.group_head()
    stack = [e]
    while stack:
        x = stack.pop()
        if x == group:
            continue
        if x.op is ExprOp.VAR and x.value == plan.head:
            return "the query head (other than as h // (Hq // Hkv))"
        stack.extend(x.args)
    return None


def row_span(item: object, dim: object, plan: PackPlan) -> bool:
    return isinstance(item, Span) and item.size == "BLOCK_M" and dim == plan.m \
        and item.start.op is ExprOp.VAR and item.start.value in plan.starts


def _check_index(tensor: str, index: tuple, p: Program, plan: PackPlan) -> str | None:
    shape = p.param(tensor).shape
    spans = [i for i, (d, it) in enumerate(zip(shape, index)) if row_span(it, d, plan)]
    heads = [i for i, (d, it) in enumerate(zip(shape, index)) if it == var(plan.head) and d == plan.hq]
    if len(spans) != len(heads) or len(spans) > 1:
        return f"{tensor} is indexed by the query head without the query-block span over {plan.m} (or the reverse)"
    for i, it in enumerate(index):
        if i in spans or i in heads or isinstance(it, Full):
            continue
        why = _uses(it.start if isinstance(it, Span) else it, plan)
        if why:
            return f"an index of {tensor} depends on {why}"
    return None


def _check_body(kern: Kernel, plan: PackPlan, p: Program, has_mask: bool) -> str | None:
    for st in walk_stmts(kern.body):
        why: str | None = None
        if isinstance(st, Let):
            why = None if st.name in plan.starts else _uses(st.value, plan)
            why = why and f"let {st.name} depends on {why}"
        elif isinstance(st, For):
            why = (_uses(st.lo, plan) or _uses(st.hi, plan)) and f"the bounds of loop {st.var} depend on the query block or head"
        elif isinstance(st, (Load, Store)):
            why = _check_index(st.tensor, st.index, p, plan)
        elif isinstance(st, (Mask, ScoreMod, IfBlock)):
            if isinstance(st, IfBlock) and has_mask:
                why = "a block test under a mask_mod (the class of a packed tile would mix query positions)"
            elif not (st.at.q_start.op is ExprOp.VAR and st.at.q_start.value in plan.starts):
                why = f"a {st.op.value} at q_start {st.at.q_start} that is not the query-block start"
            elif st.at.h != var(plan.head) and _uses(st.at.h, plan):
                why = f"a {st.op.value} whose head {st.at.h} depends on the query head"
            else:
                why = _uses(st.at.b, plan) or _uses(st.at.kv_start, plan)
                why = why and f"a {st.op.value} whose batch / kv_start depends on {why}"
        elif not isinstance(st, (For, IfBlock)):
            names = {n for f in ("value",) if isinstance(getattr(st, f, None), Expr) for n in free_vars(getattr(st, f))}
            if names & ({plan.head, plan.rows} | plan.starts):
                why = f"{st.op.value} {getattr(st, 'out', '')} reads the query head or block as a value"
        if why:
            return why
    return None

