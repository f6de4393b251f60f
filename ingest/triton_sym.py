"""Polynomial normal form for integer index math lifted from Triton kernels.

Triton writes positions as `start_m * BLOCK_M + tl.arange(0, BLOCK_M)` and
`start_n + offs_n + (seqlen_q - seqlen_k)`; the IR wants `q_idx`, `kv_idx`. `normalize`
expands sums and products into monomials over atoms (variables and non-polynomial nodes
such as `cdiv(...)`, `abs(...)`, loads), so that `m * BLOCK_M + (q_idx - m * BLOCK_M)`
cancels to `q_idx`. `compare` renders `a OP b` with positive terms on the left.

Invariant: `to_expr(normalize(e))` is arithmetically equal to `e` for integer/real values
(floor division, modulo and calls are atoms; their arguments are normalized recursively).
"""

from __future__ import annotations

from kb.ir.expr import Expr, ExprOp, const, print_expr

__all__ = ["Poly", "normalize", "to_expr", "simplify", "compare", "scale_poly"]

Monomial = tuple[Expr, ...]
Poly = dict[Monomial, float | int]

_SHAPE = (ExprOp.ADD, ExprOp.SUB, ExprOp.MUL, ExprOp.NEG)


def _key(e: Expr) -> str:
    return print_expr(e)


def _num(x: float | int) -> float | int:
    if isinstance(x, float) and abs(x - round(x)) < 1e-9:
        return int(round(x))
    return x


def _add(a: Poly, b: Poly, sign: int = 1) -> Poly:
    out = dict(a)
    for m, c in b.items():
        out[m] = _num(out.get(m, 0) + sign * c)
        if out[m] == 0:
            del out[m]
    return out


def _mul(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            m = tuple(sorted(ma + mb, key=_key))
            out[m] = _num(out.get(m, 0) + ca * cb)
            if out[m] == 0:
                del out[m]
    return out


def scale_poly(p: Poly, k: float | int) -> Poly:
    return {m: _num(c * k) for m, c in p.items() if _num(c * k) != 0}


def normalize(e: Expr) -> Poly:
    if e.op is ExprOp.CONST and isinstance(e.value, (int, float)) and not isinstance(e.value, bool):
        return {(): e.value} if e.value != 0 else {}
    if e.op is ExprOp.ADD:
        return _add(normalize(e.args[0]), normalize(e.args[1]))
    if e.op is ExprOp.SUB:
        return _add(normalize(e.args[0]), normalize(e.args[1]), -1)
    if e.op is ExprOp.NEG:
        return scale_poly(normalize(e.args[0]), -1)
    if e.op is ExprOp.MUL:
        return _mul(normalize(e.args[0]), normalize(e.args[1]))
    atom = e if not e.args else Expr(e.op, tuple(simplify(a) for a in e.args), e.value)
    return {(atom,): 1}


def _mono_expr(m: Monomial) -> Expr:
    if not m:
        return const(1)
    out = m[0]
    for a in m[1:]:
        out = Expr(ExprOp.MUL, (out, a))
    return out


def _order(m: Monomial) -> tuple:
    # index variables first, then everything else by text; constants last
    rank = 0 if any(a.op is ExprOp.VAR and a.value in ("q_idx", "kv_idx") for a in m) else 1
    return (len(m) == 0, rank, [_key(a) for a in m])


def to_expr(p: Poly) -> Expr:
    if not p:
        return const(0)
    out: Expr | None = None
    for m in sorted(p, key=_order):
        c = p[m]
        mag = abs(c)
        term = const(mag) if not m else (_mono_expr(m) if mag == 1 else Expr(ExprOp.MUL, (const(mag), _mono_expr(m))))
        if out is None:
            out = term if c > 0 else (const(c) if not m else Expr(ExprOp.NEG, (term,)))
        else:
            out = Expr(ExprOp.ADD if c > 0 else ExprOp.SUB, (out, term))
    assert out is not None
    return out


def simplify(e: Expr) -> Expr:
    """Normal form of arithmetic subtrees; other nodes keep their shape with simplified children."""
    if e.op in _SHAPE or (e.op is ExprOp.CONST and not isinstance(e.value, bool)):
        return to_expr(normalize(e))
    if not e.args:
        return e
    return Expr(e.op, tuple(simplify(a) for a in e.args), e.value)


_FLIP = {ExprOp.LT: ExprOp.GT, ExprOp.LE: ExprOp.GE, ExprOp.GT: ExprOp.LT, ExprOp.GE: ExprOp.LE,
         ExprOp.EQ: ExprOp.EQ, ExprOp.NE: ExprOp.NE}


def compare(op: ExprOp, lhs: Expr, rhs: Expr) -> Expr:
    """`lhs op rhs` rearranged: positive monomials of lhs - rhs on the left, the rest on the right.

    If q_idx would end up on the right, the comparison is flipped so it reads `q_idx ... kv_idx`.
    """
    d = _add(normalize(lhs), normalize(rhs), -1)
    left = {m: c for m, c in d.items() if c > 0}
    right = {m: -c for m, c in d.items() if c < 0}
    q = Expr(ExprOp.VAR, (), "q_idx")
    if any(q in m for m in right) and not any(q in m for m in left):
        left, right, op = right, left, _FLIP[op]
    return Expr(op, (to_expr(left), to_expr(right)))
