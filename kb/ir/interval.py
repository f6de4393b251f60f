"""Bounds of an expression over a box of its variables (interval arithmetic), as expressions.

`bounds(e, box)` gives `(lo, hi)` with lo <= e <= hi at every point of the box, or None where some node has no
rule here (a load, a division by a non-constant, a modulo). `box` maps a variable to its `(lo, hi)` expressions;
any other free variable is a point. The lowerings use it to find a score tile over which a table index is one value
(a T5 relative bucket is the same for every offset past its largest distance), so the table is read once per tile
instead of per element.

Rules: `+ - neg`, `*` and `/` by a constant (sign-aware), `*` of two ranges (the four products), `//`, `<<`, `>>`,
cdiv by a positive constant; `abs`, `minimum`, `maximum`; the increasing calls (exp, exp2, log, sqrt, trunc, tanh,
sigmoid, erf) map ends to ends. A condition (a comparison, `&`, `|`, `~` of conditions, a bool constant) is a range
of booleans: `lo` true where it holds at every point, `hi` where it holds at some. `where(c, x, y)` is x's range
where c always holds, y's where it never does, else their union. Each end is computed with the operations the
pointwise expression uses, so rounding (monotone) keeps the ends on the right side; the approximate hardware log and
exp are taken as monotone.
"""

from __future__ import annotations

from kb.ir.expr import Expr, ExprOp, call, const, number

__all__ = ["Range", "bounds"]

Range = tuple[Expr, Expr]

_INCREASING = {ExprOp.EXP, ExprOp.EXP2, ExprOp.LOG, ExprOp.SQRT, ExprOp.TRUNC, ExprOp.TANH, ExprOp.SIGMOID,
               ExprOp.ERF}
_COMPARE = {ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE, ExprOp.EQ, ExprOp.NE}


def bounds(e: Expr, box: dict[str, Range]) -> Range | None:
    """(lo, hi) of `e` over `box` (variable -> its range; other variables are points), or None where no rule applies."""
    if e.op is ExprOp.CONST:
        return e, e
    if e.op is ExprOp.VAR:
        return box.get(str(e.value), (e, e))
    if _is_condition(e):
        return _condition(e, box)
    args = [bounds(a, box) for a in e.args]
    if any(r is None for r in args):
        return None
    ranges: list[Range] = [r for r in args if r is not None]
    return _arith(e, ranges)


def _arith(e: Expr, r: list[Range]) -> Range | None:
    op = e.op
    if op is ExprOp.ADD:
        return r[0][0] + r[1][0], r[0][1] + r[1][1]
    if op is ExprOp.SUB:
        return r[0][0] - r[1][1], r[0][1] - r[1][0]
    if op is ExprOp.NEG:
        return -r[0][1], -r[0][0]
    if op is ExprOp.MUL:
        return _mul(e.args, r)
    if op in (ExprOp.DIV, ExprOp.FLOORDIV, ExprOp.SHL, ExprOp.SHR, ExprOp.CDIV):
        c = _constant(e.args[1])
        if c is None or c == 0 or (op is not ExprOp.DIV and c < 0):
            return None  # by a range, or a shift/floor by a negative: no rule
        lo, hi = (r[0][1], r[0][0]) if c < 0 else r[0]  # only `/` can have c < 0 here
        return Expr(op, (lo, e.args[1])), Expr(op, (hi, e.args[1]))
    if op in (ExprOp.MINIMUM, ExprOp.MAXIMUM):
        return Expr(op, (r[0][0], r[1][0])), Expr(op, (r[0][1], r[1][1]))
    if op is ExprOp.ABS:
        lo, hi = r[0]
        return call("maximum", call("maximum", lo, -hi), const(0)), call("maximum", -lo, hi)
    if op in _INCREASING:
        return Expr(op, (r[0][0],)), Expr(op, (r[0][1],))
    if op is ExprOp.WHERE and _is_condition(e.args[0]):
        (always, some), x, y = r
        return (call("where", always, x[0], call("where", some, call("minimum", x[0], y[0]), y[0])),
                call("where", always, x[1], call("where", some, call("maximum", x[1], y[1]), y[1])))
    return None  # MOD, bitwise AND/OR/NOT of integers, LOAD


def _mul(args: tuple[Expr, ...], r: list[Range]) -> Range:
    for i in (0, 1):
        c = _constant(args[i])
        if c is not None:
            lo, hi = r[1 - i]
            return (args[i] * lo, args[i] * hi) if c >= 0 else (args[i] * hi, args[i] * lo)
    products = [a * b for a in r[0] for b in r[1]]
    lo, hi = products[0], products[0]
    for p in products[1:]:
        lo, hi = call("minimum", lo, p), call("maximum", hi, p)
    return lo, hi


def _constant(e: Expr) -> int | float | None:
    return number(e) if e.op is ExprOp.CONST and not isinstance(e.value, bool) else None


def _is_condition(e: Expr) -> bool:
    """A boolean by its structure (so `&`, `|`, `~` are logical here, never bitwise)."""
    if e.op is ExprOp.CONST:
        return isinstance(e.value, bool)
    if e.op in _COMPARE:
        return True
    if e.op in (ExprOp.AND, ExprOp.OR, ExprOp.NOT):
        return all(_is_condition(a) for a in e.args)
    return False


def _condition(e: Expr, box: dict[str, Range]) -> Range | None:
    """(holds everywhere, holds somewhere) of a condition over the box; a WHERE's condition is read here too."""
    if e.op is ExprOp.CONST:
        return e, e
    if e.op is ExprOp.NOT:
        r = _condition(e.args[0], box)
        return None if r is None else (~r[1], ~r[0])
    if e.op in (ExprOp.AND, ExprOp.OR):
        a, b = _condition(e.args[0], box), _condition(e.args[1], box)
        if a is None or b is None:
            return None
        return Expr(e.op, (a[0], b[0])), Expr(e.op, (a[1], b[1]))
    a, b = bounds(e.args[0], box), bounds(e.args[1], box)
    if a is None or b is None:
        return None
    (alo, ahi), (blo, bhi) = a, b
    if e.op is ExprOp.GT:
        return alo > bhi, ahi > blo
    if e.op is ExprOp.GE:
        return alo >= bhi, ahi >= blo
    if e.op is ExprOp.LT:
        return ahi < blo, alo < bhi
    if e.op is ExprOp.LE:
        return ahi <= blo, alo <= bhi
    same_point = alo.eq(ahi) & blo.eq(bhi) & alo.eq(blo)
    overlap = (alo <= bhi) & (blo <= ahi)
    if e.op is ExprOp.EQ:
        return same_point, overlap
    return ~overlap, ~same_point  # NE

