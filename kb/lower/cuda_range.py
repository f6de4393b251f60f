"""Integer ranges of IR expressions, for the 32-bit index math of the CUDA lowerings (kb.lower.cuda_mma's
score-fragment loops, kb.lower.cuda_sm90_ir's hooks).

64-bit integer ops are emulated on the GPU, so those lowerings compute an integer in `int` wherever its range
provably fits. The proof starts from the launcher's promise: it refuses runtime dims above `KB_DIM_LIMIT`
(returning `KB_ERR_RANGE`), so every dim lies in [0, KB_DIM_LIMIT]; `ival` carries bounds through an expression
and `narrow_ints` is the `IntWidth.narrow` predicate built from it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from kb.ir.expr import Expr, ExprOp, walk
from kb.ir.nodes import Dtype
from kb.lower.expr_context import CMP_OPS, Kind

__all__ = ["Ival", "UNBOUNDED", "KB_DIM_LIMIT", "KB_ERR_RANGE", "ival", "fits32", "shift", "hoistable",
           "narrow_ints"]

# The launcher refuses runtime dims above this (KB_ERR_RANGE), so that q_idx, kv_idx and the variant arithmetic
# on them provably fit 32-bit ints.
KB_DIM_LIMIT = 2**30 - 1
KB_ERR_RANGE = -3

Ival = tuple[int | None, int | None]  # inclusive bounds; None: unbounded on that side
UNBOUNDED: Ival = (None, None)
_I32: tuple[int, int] = (-(2**31), 2**31 - 1)


def fits32(r: Ival) -> bool:
    return r[0] is not None and r[1] is not None and _I32[0] <= r[0] and r[1] <= _I32[1]


def shift(r: Ival, lo: int, hi: int) -> Ival:
    """[r.lo + lo, r.hi + hi]."""
    return (None if r[0] is None else r[0] + lo, None if r[1] is None else r[1] + hi)


def _known(xs: Iterable[int | None]) -> list[int] | None:
    """`xs` when every bound is known, else None."""
    out: list[int] = []
    for x in xs:
        if x is None:
            return None
        out.append(x)
    return out


def _closed(rs: Iterable[Ival]) -> list[tuple[int, int]] | None:
    """`rs` when every range is bounded on both sides, else None."""
    out: list[tuple[int, int]] = []
    for lo, hi in rs:
        if lo is None or hi is None:
            return None
        out.append((lo, hi))
    return out


def ival(e: Expr, env: Mapping[str, Ival], aux: Mapping[str, Dtype]) -> Ival:
    """Conservative bounds of an integer expression (Python semantics) given bounds of its names and the element
    types of the aux tensors it loads."""
    op = e.op
    if op is ExprOp.CONST:
        v = e.value
        return (int(v), int(v)) if isinstance(v, (bool, int)) else UNBOUNDED
    if op is ExprOp.VAR:
        return env.get(str(e.value), UNBOUNDED)
    if op is ExprOp.LOAD:
        dtype = aux.get(str(e.value))
        return _I32 if dtype is Dtype.I32 else (0, 1) if dtype is Dtype.BOOL else UNBOUNDED
    if op in CMP_OPS:
        return (0, 1)
    a = [ival(x, env, aux) for x in e.args]
    closed = _closed(a)
    if op in (ExprOp.AND, ExprOp.OR, ExprOp.NOT):
        return _bitwise_ival(e, a, closed)
    if op is ExprOp.SHR and closed is not None and closed[0][0] >= 0 and closed[1][0] >= 0:
        return (closed[0][0] >> closed[1][1], closed[0][1] >> closed[1][0])
    if op is ExprOp.ADD:
        return (None if a[0][0] is None or a[1][0] is None else a[0][0] + a[1][0],
                None if a[0][1] is None or a[1][1] is None else a[0][1] + a[1][1])
    if op is ExprOp.SUB:
        return (None if a[0][0] is None or a[1][1] is None else a[0][0] - a[1][1],
                None if a[0][1] is None or a[1][0] is None else a[0][1] - a[1][0])
    if op is ExprOp.NEG:
        return (None if a[0][1] is None else -a[0][1], None if a[0][0] is None else -a[0][0])
    if op is ExprOp.MUL and closed is not None:
        prods = [x * y for x in closed[0] for y in closed[1]]
        return (min(prods), max(prods))
    if op in (ExprOp.FLOORDIV, ExprOp.CDIV) and closed is not None and closed[1][0] > 0:
        # floor(x / d) with d > 0 is monotone in x, and in d for x of one sign: the corners bound it
        num = closed[0] if op is ExprOp.FLOORDIV else (-closed[0][1], -closed[0][0])
        q = [x // d for x in num for d in closed[1]]
        return (min(q), max(q)) if op is ExprOp.FLOORDIV else (-max(q), -min(q))
    if op is ExprOp.MOD and a[1][0] is not None and a[1][0] > 0 and a[1][1] is not None:
        return (0, a[1][1] - 1)
    if op is ExprOp.MAXIMUM:
        some_lo, all_hi = [r[0] for r in a if r[0] is not None], _known(r[1] for r in a)
        return (max(some_lo) if some_lo else None, None if all_hi is None else max(all_hi))
    if op is ExprOp.MINIMUM:
        all_lo, some_hi = _known(r[0] for r in a), [r[1] for r in a if r[1] is not None]
        return (None if all_lo is None else min(all_lo), min(some_hi) if some_hi else None)
    if op is ExprOp.ABS and closed is not None:
        lo, hi = closed[0]
        return (lo, hi) if lo >= 0 else (-hi, -lo) if hi <= 0 else (0, max(-lo, hi))
    if op is ExprOp.WHERE:
        values = _closed(a[1:])
        if values is not None:
            return (min(r[0] for r in values), max(r[1] for r in values))
    return UNBOUNDED


def _bitwise_ival(e: Expr, a: list[Ival], closed: list[tuple[int, int]] | None) -> Ival:
    """`&`, `|`, `~`: logical (0 or 1) on booleans, bitwise on integers; non-negative operands bound the result."""
    if closed is not None and all(0 <= lo and hi <= 1 for lo, hi in closed):
        return (0, 1)
    if e.op is ExprOp.AND and any(lo is not None and lo >= 0 and hi is not None for lo, hi in a):
        return (0, min(hi for lo, hi in a if lo is not None and lo >= 0 and hi is not None))
    if e.op is ExprOp.OR and closed is not None and all(lo >= 0 for lo, _ in closed):
        return (0, (1 << max(hi for _, hi in closed).bit_length()) - 1)
    return UNBOUNDED


def hoistable(e: Expr, kind: Callable[[Expr], Kind]) -> bool:
    """Evaluating `e` where the per-element code might not have (a lazy `&&`/`?:` operand) is harmless: pure,
    loads guarded, and no integer division by a value that might be 0."""
    return not any(n.op in (ExprOp.FLOORDIV, ExprOp.MOD, ExprOp.CDIV) and kind(n) is Kind.INT
                   and not (n.args[1].op is ExprOp.CONST and n.args[1].value) for n in walk(e))


def narrow_ints(env: Mapping[str, Ival], aux: Mapping[str, Dtype], kind: Callable[[Expr], Kind]) -> Callable[[Expr], bool]:
    """`IntWidth.narrow` from ranges: an integer node is `int` when its range fits and so do its integer operands'
    (an aux load's value is its element's). `env` and `kind` are read at each first question, so a caller may
    bind more names as it goes; answers are remembered."""
    memo: dict[Expr, bool] = {}

    def narrow(e: Expr) -> bool:
        if e not in memo:
            memo[e] = fits32(ival(e, env, aux)) and (e.op is ExprOp.LOAD or all(
                narrow(a) for a in e.args if kind(a) is Kind.INT))
        return memo[e]
    return narrow
