"""Block-mask planning: how `if block(...) is CLASS` is decided for a program's mask_mod, shared by the lowerings.

- NO_MASK: no mask_mod; a tile's class follows from its bounds alone.
- ANALYTIC: mask_mod is an `|` of conjunctions of bounds on linear forms in q_idx/kv_idx with unit coefficients
  (causal, sliding window, offsets; prefix-LM with a constant, 0-d or per-batch prefix; a packed sequence's
  bottom-right causal bound together with its end, `kv_idx < cu_seqlens_k[b + 1]`). A tile's class is then decided
  in closed form on its corners (`_block_tests`), and a forward KV loop can be split into partial / full / partial
  parts (`full_span`, `union_span`, `kv_reach`). A conjunction over several forms is full exactly when each form
  holds on the whole tile; it is called empty when one form misses the whole tile (a tile every form touches
  but no pair satisfies is called partial: its mask code still runs, so nothing changes but a skipped block).
- TABLE: anything else; the host fills a block-class table [B|1, H|1, n_m_blocks, n_n_blocks] int8 with the codes
  below (0 empty, 1 partial, 2 full) that the kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kb.ir.algebra import FLIP, all_of, any_of, conjuncts, disjuncts, linear_form, min_of, tidy_int
from kb.ir.expr import Expr, ExprOp, call, const, free_vars, loaded_tensors, substitute, var, walk
from kb.ir.nodes import BlockClass, IfBlock, Program, Role
from kb.lower.expr_context import DTYPE_KIND, Kind

__all__ = ["BlockMaskKind", "LinearBounds", "Conjunct", "BlockMaskPlan", "plan_block_mask", "block_class_test", "EMPTY", "PARTIAL",
           "FULL", "CLASS_CODE", "full_span", "union_span", "kv_reach", "transposed"]

EMPTY, PARTIAL, FULL = 0, 1, 2
CLASS_CODE = {BlockClass.EMPTY: EMPTY, BlockClass.PARTIAL: PARTIAL, BlockClass.FULL: FULL}  # host-table codes


class BlockMaskKind(Enum):
    NO_MASK = "no_mask"  # classes follow from the tile bounds alone
    ANALYTIC = "analytic"  # an `|` of conjunctions of L_i <= alpha*q_idx + beta*kv_idx <= U_j, decided on the tile corners
    TABLE = "table"  # host-computed table, read by the kernel


@dataclass(frozen=True)
class LinearBounds:
    """`L_i <= alpha*q_idx + beta*kv_idx <= U_j` for every bound: the bounds of one conjunct of mask_mod's `|` on one
    linear form (one direction).

    Bounds are integer Exprs over b, h, dims, int scalars and loads from int aux tensors at indices free
    of q_idx/kv_idx (a per-batch prefix length `prefix[b]`), so a program reads them once."""

    alpha: int
    beta: int
    lower: tuple[Expr, ...] = ()
    upper: tuple[Expr, ...] = ()


Conjunct = tuple[LinearBounds, ...]  # one conjunct of mask_mod's `|`: the `&` of bounds on distinct linear forms


@dataclass(frozen=True)
class BlockMaskPlan:
    kind: BlockMaskKind
    disjuncts: tuple[Conjunct, ...] = ()  # ANALYTIC: the mask is their `|`; a block is full when one of them
    # covers it, empty when every one misses it (exact for one disjunct of one form; prefix-LM = two)
    per_b: bool = False  # TABLE: does the class depend on b / h?
    per_h: bool = False


_BOUNDS = FLIP.keys() - {ExprOp.NE}  # the comparisons a bound can be read from


def _int_expr(e: Expr) -> bool:
    return all(n.op not in (ExprOp.DIV, ExprOp.EXP, ExprOp.EXP2, ExprOp.LOG, ExprOp.TANH, ExprOp.SIGMOID, ExprOp.SQRT)
               and not (n.op is ExprOp.CONST and isinstance(n.value, float)) for n in walk(e))


def plan_block_mask(p: Program) -> BlockMaskPlan:
    """Decide how block classes are computed for `p`'s mask_mod (see module docstring)."""
    if p.mask_mod is None:
        return BlockMaskPlan(BlockMaskKind.NO_MASK)
    not_int = {q.name for q in p.params if q.role in (Role.SCALAR, Role.AUX) and DTYPE_KIND[q.dtype] is not Kind.INT}
    bounds = [_linear_bounds(d, not_int) for d in disjuncts(p.mask_mod.body)]
    if any(d is None for d in bounds):
        return _table_plan(p)
    return BlockMaskPlan(BlockMaskKind.ANALYTIC, tuple(d for d in bounds if d is not None))


def _linear_bounds(e: Expr, not_int: set[str]) -> Conjunct | None:
    """`e` as bounds on linear forms of q_idx/kv_idx with unit coefficients, one LinearBounds per form, or None."""
    lower: dict[tuple[int, int], list[Expr]] = {}
    upper: dict[tuple[int, int], list[Expr]] = {}
    for atom in conjuncts(e):
        lin = linear_form(atom.args[0] - atom.args[1]) if atom.op in _BOUNDS else None
        if lin is None or (lin[0], lin[1]) == (0, 0) or not _int_expr(lin[2]) \
                or (free_vars(lin[2]) | loaded_tensors(lin[2])) & not_int:
            return None
        a, b, c = lin
        op = atom.op
        if (a, b) < (0, 0) or (a == 0 and b < 0):  # canonical sign: first nonzero coefficient positive
            a, b, c, op = -a, -b, Expr(ExprOp.NEG, (c,)), FLIP[op]
        if abs(a) > 1 or abs(b) > 1:
            return None
        lo, up = lower.setdefault((a, b), []), upper.setdefault((a, b), [])
        r = Expr(ExprOp.NEG, (c,))  # a*q + b*kv  op  r
        if op in (ExprOp.GE, ExprOp.EQ):
            lo.append(r)
        if op is ExprOp.GT:
            lo.append(r + 1)
        if op in (ExprOp.LE, ExprOp.EQ):
            up.append(r)
        if op is ExprOp.LT:
            up.append(r - 1)
    return tuple(LinearBounds(a, b, tuple(lower[a, b]), tuple(upper[a, b])) for a, b in lower)


def _table_plan(p: Program) -> BlockMaskPlan:
    fv = free_vars(p.mask_mod.body) if p.mask_mod else frozenset()
    return BlockMaskPlan(BlockMaskKind.TABLE, per_b="b" in fv, per_h="h" in fv)


def _block_tests(plan: BlockMaskPlan, st: IfBlock, m_dim: str, n_dim: str) -> tuple[Expr, Expr]:
    """(is_empty, is_full) of the BLOCK_M x BLOCK_N tile at st.at as scalar Exprs."""
    q0, k0 = st.at.q_start, st.at.kv_start
    q1 = call("minimum", q0 + var("BLOCK_M"), var(m_dim)) - 1
    k1 = call("minimum", k0 + var("BLOCK_N"), var(n_dim)) - 1
    empty = [q0 > q1, k0 > k1]
    full = [q0 <= q1, k0 + var("BLOCK_N") <= var(n_dim)]
    if plan.kind is BlockMaskKind.ANALYTIC:
        tests = [_conjunct_tests(d, (q0, q1), (k0, k1), {"b": st.at.b, "h": st.at.h}) for d in plan.disjuncts]
        if len(tests) == 1:
            empty += tests[0][0]
            full += tests[0][1]
        else:
            empty.append(all_of([any_of(e) for e, _ in tests]))
            full.append(any_of([all_of(f) for _, f in tests]))
    return tidy_int(any_of(empty)), tidy_int(all_of(full))


def block_class_test(plan: BlockMaskPlan, st: IfBlock, m_dim: str, n_dim: str) -> Expr:
    """`block(...) is st.cls` (before `st.negate`) of the tile at st.at, in closed form."""
    empty, full = _block_tests(plan, st, m_dim, n_dim)
    if st.cls is BlockClass.FULL:
        return full
    if st.cls is BlockClass.EMPTY:
        return empty
    return ~empty & ~full


def _form_range(d: LinearBounds, q: tuple[Expr, Expr], k: tuple[Expr, Expr]) -> tuple[Expr, Expr]:
    """(min, max) of alpha*q_idx + beta*kv_idx over q_idx in [q0, q1], kv_idx in [k0, k1]."""
    lo_terms: list[Expr] = []
    hi_terms: list[Expr] = []
    for coef, (lo, hi) in ((d.alpha, q), (d.beta, k)):
        if coef == 1:
            lo_terms.append(lo)
            hi_terms.append(hi)
        elif coef == -1:
            lo_terms.append(Expr(ExprOp.NEG, (hi,)))
            hi_terms.append(Expr(ExprOp.NEG, (lo,)))
    g_min, g_max = lo_terms[0], hi_terms[0]
    for a, b in zip(lo_terms[1:], hi_terms[1:]):
        g_min, g_max = g_min + a, g_max + b
    return g_min, g_max


def _conjunct_tests(c: Conjunct, q: tuple[Expr, Expr], k: tuple[Expr, Expr],
                    at: dict[str, Expr]) -> tuple[list[Expr], list[Expr]]:
    """(terms of `misses every pair of the tile`: any holds, terms of `holds on every pair`: all hold) for one
    conjunct: each form's terms (module docstring: exact for one form, an empty test that may miss for several)."""
    empty: list[Expr] = []
    full: list[Expr] = []
    for d in c:
        e, f = _form_tests(d, q, k, at)
        empty += e
        full += f
    return empty, full


def _form_tests(d: LinearBounds, q: tuple[Expr, Expr], k: tuple[Expr, Expr],
                at: dict[str, Expr]) -> tuple[list[Expr], list[Expr]]:
    """`_conjunct_tests` for the bounds on one form: exact, since the form takes every integer value between its min
    and max on a tile."""
    g_min, g_max = _form_range(d, q, k)
    lower = [substitute(x, at) for x in d.lower]
    upper = [substitute(x, at) for x in d.upper]
    empty = [g_max < x for x in lower] + [g_min > x for x in upper]
    empty += [x > y for x in lower for y in upper]
    full = [g_min >= x for x in lower] + [g_max <= x for x in upper]
    return empty, full


def _part_range(coef: int, lo: Expr, hi: Expr) -> tuple[Expr, Expr]:
    """(min, max) of coef * x for x in [lo, hi], coef in {-1, 0, 1}."""
    if coef == 0:
        return const(0), const(0)
    return (lo, hi) if coef == 1 else (Expr(ExprOp.NEG, (hi,)), Expr(ExprOp.NEG, (lo,)))


def transposed(c: Conjunct) -> Conjunct:
    """`c` with the roles of q_idx and kv_idx exchanged: for a loop over query tiles at a fixed KV tile (the backward's
    KV-outer dK/dV kernel), full_span and kv_reach of the transposed bounds give its query tiles' spans."""
    return tuple(LinearBounds(d.beta, d.alpha, d.lower, d.upper) for d in c)


def full_span(c: Conjunct, q: tuple[Expr, Expr], lo: Expr, n: Expr, at: dict[str, Expr],
              block: str = "BLOCK_N") -> tuple[Expr, Expr]:
    """[first, last]: the kv_start values whose whole `block` tile (rows q) satisfies every form of `c`, within
    [lo, n - block]."""
    span = (lo, n - var(block))
    for d in c:
        span = _narrowed(span, d, q, n, at, block)
    return span


def _narrowed(span: tuple[Expr, Expr], d: LinearBounds, q: tuple[Expr, Expr], n: Expr, at: dict[str, Expr],
              block: str) -> tuple[Expr, Expr]:
    """`span` of kv_start values narrowed to the tiles whose every pair satisfies the bounds on one form."""
    a_min, a_max = _part_range(d.alpha, *q)
    size = var(block)
    first, last = span
    for x in (substitute(x, at) for x in d.lower):  # g_min >= L
        if d.beta == -1:
            last = call("minimum", last, a_min - size + 1 - x)
        elif d.beta == 1:
            first = call("maximum", first, x - a_min)
    for x in (substitute(x, at) for x in d.upper):  # g_max <= U
        if d.beta == -1:
            first = call("maximum", first, a_max - x)
        elif d.beta == 1:
            last = call("minimum", last, x - a_max - size + 1)
    if d.beta == 0:  # the rows alone decide: every block or none
        rows = all_of([a_min >= substitute(x, at) for x in d.lower] + [a_max <= substitute(x, at) for x in d.upper])
        first = call("where", rows, first, n)
    return first, last


def union_span(a: tuple[Expr, Expr], b: tuple[Expr, Expr]) -> tuple[Expr, Expr]:
    """One interval of full blocks inside the union of two: both when they overlap or touch, else the longer."""
    (f1, l1), (f2, l2) = a, b
    if f1 == f2:
        return f1, call("maximum", l1, l2)
    meet = (f2 <= l1 + 1) & (f1 <= l2 + 1)
    longer = l1 - f1 >= l2 - f2

    return (call("where", meet, call("minimum", f1, f2), call("where", longer, f1, f2)),
            call("where", meet, call("maximum", l1, l2), call("where", longer, l1, l2)))


def kv_reach(c: Conjunct, q: tuple[Expr, Expr], n: Expr, at: dict[str, Expr]) -> Expr:
    """An exclusive bound on kv_start past which every tile of rows q misses `c` (one of its forms misses)."""
    return min_of([_form_reach(d, q, n, at) for d in c])


def _form_reach(d: LinearBounds, q: tuple[Expr, Expr], n: Expr, at: dict[str, Expr]) -> Expr:
    """`kv_reach` of the bounds on one form."""
    a_min, a_max = _part_range(d.alpha, *q)
    if d.beta == -1 and d.lower:  # g_max = a_max - kv_start >= L
        return min_of([a_max - substitute(x, at) + 1 for x in d.lower])
    if d.beta == 1 and d.upper:  # g_min = a_min + kv_start <= U
        return min_of([substitute(x, at) - a_min + 1 for x in d.upper])
    return n
