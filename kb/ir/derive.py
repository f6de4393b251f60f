"""Symbolic derivatives of variant expressions, for backward programs.

`score_grad(body)` is d score_mod / d score as an Expr over the same names (score, b, h, q_idx,
kv_idx, scalars, aux loads); `aux_partials(body, tensor)` gives, for each distinct load
`tensor[idx...]` in the body, its index exprs and d body / d tensor[idx...].

Rules: integer and boolean subexpressions (comparisons, `//`, `%`, `cdiv`, `trunc`, bitwise ops and shifts,
loads of int tensors used as indices) are piecewise constant, so their derivative is 0; `where(c, a, b)` differentiates
its branches; `maximum`/`minimum` take the branch they select (ties go to the first argument);
`abs` has derivative sign(x) with sign(0) = 1. Results are simplified (0 and 1 folded), so
`score + slopes[h] * (kv_idx - q_idx)` has derivative `1` and softcap's `c * tanh(score / c)`
gives `c * ((1 - tanh(score / c) * tanh(score / c)) * (1 / c))`.

`row_centre(body, index, partial)` is the row centre of a centred `aux_grad` (`kb.ir.nodes.AuxGrad`):
an Expr over the variant names and `ROW_LSE` (the row's lse; the evaluator binds it to 0 where lse is
infinite: an empty row, whose ds is 0, or a row past M) that is the same for every kv_idx of a row, so
subtracting it from the partial leaves the gradient unchanged (each row of ds sums to 0). It is chosen
so the centred partial is small where P is large: for a score_mod affine in score with a slope and
offset that are row constants, `body = a * score + c0`, and a partial `g = r * score + g0`, the centre
`g0 + (r / a) * (lse - c0)` leaves `(r / a) * log p` (a temperature `score * t[0]`: `(score * t[0] - lse) / t[0]`
instead of `score`, whose common offset over a row is what the rounding of ds's row sums multiplies).
"""

from __future__ import annotations

import math
from typing import Callable

from kb.ir.expr import Expr, ExprOp, call, const, free_vars, replace_subexprs, substitute, var, walk

__all__ = ["score_grad", "aux_partials", "derivative", "row_centre", "ROW_LSE"]

ROW_LSE = "__lse__"  # the row's lse in a row centre (never a name of a program: not an identifier it may define)
_ALONG_ROW = frozenset({"score", "kv_idx"})  # what varies along a row of a score tile

_ZERO_OPS = frozenset({
    ExprOp.CONST, ExprOp.LOAD, ExprOp.FLOORDIV, ExprOp.MOD, ExprOp.CDIV, ExprOp.LT, ExprOp.LE, ExprOp.GT,
    ExprOp.GE, ExprOp.EQ, ExprOp.NE, ExprOp.AND, ExprOp.OR, ExprOp.NOT, ExprOp.TRUNC, ExprOp.SHL, ExprOp.SHR,
})
_HOLE = "__wrt__"  # the variable a load occurrence is replaced by while differentiating w.r.t. it


def score_grad(body: Expr) -> Expr:
    """d body / d score."""
    return derivative(body, "score")


def aux_partials(body: Expr, tensor: str) -> tuple[tuple[tuple[Expr, ...], Expr], ...]:
    """((index exprs, d body / d tensor[index]) for each distinct load of `tensor` in `body`)."""
    loads = list(dict.fromkeys(n for n in walk(body) if n.op is ExprOp.LOAD and n.value == tensor))
    out = []
    for ld in loads:
        holed = replace_subexprs(body, {ld: var(_HOLE)})
        out.append((ld.args, replace_subexprs(derivative(holed, _HOLE), {var(_HOLE): ld})))
    return tuple(out)


def row_centre(body: Expr, index: tuple[Expr, ...], partial: Expr) -> Expr | None:
    """The row centre of `partial` (d body / d aux[index]), or None where there is none worth subtracting: the
    index moves along a row (each element of a row then has its own gradient entry), or the partial is not
    affine in score. See the module docstring."""
    if any(free_vars(i) & _ALONG_ROW for i in index):
        return None
    rate = _fold(derivative(partial, "score"))
    if not _row_constant(rate):
        return None
    g0 = _fold(substitute(partial, {"score": const(0)}))
    centre = g0 if _row_constant(g0) else const(0)
    slope = _fold(score_grad(body))
    if not _is(rate, 0) and _row_constant(slope):
        c0 = _fold(substitute(body, {"score": const(0)}))
        lse = _sub(var(ROW_LSE), c0) if _row_constant(c0) else var(ROW_LSE)
        centre = _add(centre, _mul(_ratio(rate, slope), lse))
    return None if _is(centre, 0) else centre


def _row_constant(e: Expr) -> bool:
    return not free_vars(e) & _ALONG_ROW


def _ratio(a: Expr, b: Expr) -> Expr:
    """a / b, 0 where b is 0 (a centre only has to be finite and the same along the row)."""
    if b.op is ExprOp.CONST and not _is(b, 0):
        return _div(a, b)
    return call("where", b.ne(0), _div(a, b), const(0))


def _fold(e: Expr) -> Expr:
    """`e` rebuilt bottom-up with the simplifying builders (0 and 1 folded)."""
    if not e.args:
        return e
    args = tuple(_fold(a) for a in e.args)
    build = _BUILDERS.get(e.op)
    return build(*args) if build is not None else Expr(e.op, args, e.value)


def derivative(e: Expr, name: str) -> Expr:
    """d e / d name, simplified."""
    if name not in {str(n.value) for n in walk(e) if n.op is ExprOp.VAR}:
        return const(0)
    if e.op is ExprOp.VAR:
        return const(1)
    if e.op in _ZERO_OPS:
        return const(0)
    return _RULES[e.op](e.args, [derivative(a, name) for a in e.args])


# ---------------------------------------------------------------- simplifying builders


def _is(e: Expr, v: float) -> bool:
    return e.op is ExprOp.CONST and not isinstance(e.value, bool) and e.value == v


def _add(a: Expr, b: Expr) -> Expr:
    return b if _is(a, 0) else a if _is(b, 0) else a + b


def _sub(a: Expr, b: Expr) -> Expr:
    return a if _is(b, 0) else -b if _is(a, 0) else a - b


def _mul(a: Expr, b: Expr) -> Expr:
    if _is(a, 0) or _is(b, 0):
        return const(0)
    return b if _is(a, 1) else a if _is(b, 1) else a * b


def _div(a: Expr, b: Expr) -> Expr:
    return const(0) if _is(a, 0) else a if _is(b, 1) else a / b


def _where(c: Expr, a: Expr, b: Expr) -> Expr:
    return a if a == b else call("where", c, a, b)


_BUILDERS: dict[ExprOp, Callable[..., Expr]] = {ExprOp.ADD: _add, ExprOp.SUB: _sub, ExprOp.MUL: _mul, ExprOp.DIV: _div,
                                               ExprOp.NEG: Expr.__neg__}  # `-x` folds a numeric constant


# ---------------------------------------------------------------- rules: (args, d args) -> derivative


def _d_div(x: tuple[Expr, ...], d: list[Expr]) -> Expr:
    # (a / b)' = a' / b - a b' / b^2
    return _sub(_div(d[0], x[1]), _div(_mul(x[0], d[1]), _mul(x[1], x[1])))


def _d_tanh(x: tuple[Expr, ...], d: list[Expr]) -> Expr:
    t = call("tanh", x[0])
    return _mul(_sub(const(1), _mul(t, t)), d[0])


def _d_erf(x: tuple[Expr, ...], d: list[Expr]) -> Expr:
    # erf'(x) = 2 / sqrt(pi) * exp(-x^2)
    return _mul(_mul(const(2.0 / math.sqrt(math.pi)), call("exp", -_mul(x[0], x[0]))), d[0])


def _d_sigmoid(x: tuple[Expr, ...], d: list[Expr]) -> Expr:
    s = call("sigmoid", x[0])
    return _mul(_mul(s, _sub(const(1), s)), d[0])


_RULES = {
    ExprOp.ADD: lambda x, d: _add(d[0], d[1]),
    ExprOp.SUB: lambda x, d: _sub(d[0], d[1]),
    ExprOp.MUL: lambda x, d: _add(_mul(d[0], x[1]), _mul(x[0], d[1])),
    ExprOp.DIV: _d_div,
    ExprOp.NEG: lambda x, d: -d[0],
    ExprOp.WHERE: lambda x, d: _where(x[0], d[1], d[2]),
    ExprOp.EXP: lambda x, d: _mul(call("exp", x[0]), d[0]),
    ExprOp.EXP2: lambda x, d: _mul(_mul(const(math.log(2.0)), call("exp2", x[0])), d[0]),
    ExprOp.LOG: lambda x, d: _div(d[0], x[0]),
    ExprOp.TANH: _d_tanh,
    ExprOp.SIGMOID: _d_sigmoid,
    ExprOp.ERF: _d_erf,
    ExprOp.ABS: lambda x, d: _mul(call("where", x[0] < 0, const(-1), const(1)), d[0]),
    ExprOp.SQRT: lambda x, d: _div(d[0], _mul(const(2), call("sqrt", x[0]))),
    ExprOp.MAXIMUM: lambda x, d: _where(x[0] >= x[1], d[0], d[1]),
    ExprOp.MINIMUM: lambda x, d: _where(x[0] <= x[1], d[0], d[1]),

}
