"""Turn shape-derived constants of traced variant expressions back into dim expressions.

Lengths (`generalize`), head counts (`generalize_heads`) and the sizes of the aux tables a constructor argument
sizes (`generalize_sizes`).

Tracing runs the spec at its own shapes, so `q_idx + (N - M)` comes out as `q_idx + 128`.
Tracing again with q and k/v lengths changed by (dM, dN) = (3, 5) (or (3, 3), or shorter by as much, for a spec
that needs M == N or holds a buffer sized to its own lengths) tells such constants apart: a constant c that moves by 3a + 5b (a, b in {-1, 0, 1}, all nine sums distinct) is
`a*M + b*N + d`. Constants that do not move stay constants; if the two traces differ in
structure, or a constant moves by anything else, the expression is left as it was (the
verifier's held-out shapes will then tell the user the kernel is shape-specialised; a spec that runs at no other
lengths at all gets a kernel that refuses them, `Spec.lengths_fixed`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kb.ir.expr import Expr, ExprOp, const, var, walk

__all__ = ["generalize", "generalize_heads", "generalize_sizes", "DELTA"]

DELTA = (3, 5)  # (dM, dN) of the second trace; (3, 3) when the spec needs M == N
_COEFFS = [(a, b) for a in (-1, 0, 1) for b in (-1, 0, 1)]


def _dim_expr(a: int, b: int, d: int) -> Expr:
    """a*M + b*N + d with a, b in {-1, 0, 1}, written the way a person would (N - M + 2, not -1*M + ...)."""
    pos = [var(n) for n, c in (("N", b), ("M", a)) if c > 0]
    neg = [var(n) for n, c in (("M", a), ("N", b)) if c < 0]
    e: Expr | None = None
    for t in pos:
        e = t if e is None else e + t
    for t in neg:
        e = -t if e is None else e - t
    if e is None:
        return const(d)
    return e if d == 0 else e + d if d > 0 else e - abs(d)



def generalize(e1: Expr | None, e2: Expr | None, dims1: tuple[int, int], dims2: tuple[int, int]) -> Expr | None:
    """`e1` (traced at (M1, N1)) with shape-derived constants replaced, using `e2` traced at (M2, N2)."""
    if e1 is None or e2 is None:
        return e1
    out = _walk(e1, e2, lambda c1, c2: _length_const(c1, c2, dims1, dims2))
    return e1 if out is None else out


def _walk(a: Expr, b: Expr, moved: Callable[[int | float, int | float], Expr | None]) -> Expr | None:
    """`a` with each constant that differs from its place in `b` replaced by `moved(a's, b's)` (numbers only, not
    booleans); None where the trees differ otherwise or `moved` has no answer."""
    if a.op is not b.op or len(a.args) != len(b.args) or (a.op is not ExprOp.CONST and a.value != b.value):
        return None
    if a.op is ExprOp.CONST:
        if a.value == b.value:
            return a
        c1, c2 = a.value, b.value
        if isinstance(c1, bool) or isinstance(c2, bool) or not isinstance(c1, int | float) or not isinstance(c2, int | float):
            return None
        return moved(c1, c2)
    args = []
    for x, y in zip(a.args, b.args):
        g = _walk(x, y, moved)
        if g is None:
            return None
        args.append(g)
    return Expr(a.op, tuple(args), a.value)


def _length_const(c1: int | float, c2: int | float, d1: tuple[int, int], d2: tuple[int, int]) -> Expr | None:
    if not isinstance(c1, int) or not isinstance(c2, int):
        return None
    dm, dn = d2[0] - d1[0], d2[1] - d1[1]
    for ca, cb in _COEFFS:
        if ca * dm + cb * dn == c2 - c1:
            return _dim_expr(ca, cb, c1 - ca * d1[0] - cb * d1[1])
    return None


def generalize_heads(e1: Expr | None, e2: Expr | None, heads1: tuple[int, int], heads2: tuple[int, int]) -> tuple[bool, Expr | None]:
    """(ok, `e1` with head-count constants written in Hq or Hkv), from `e2` traced at other (Hq, Hkv): ALiBi slopes
    built in forward from q.shape[1] trace to `exp2((h + 1) * -8.0 / 4)` at Hq=4. A constant c that differs
    between the traces is `Hq` (or `Hkv`) where it equals it in both, else `k * Hq` or `k / Hq` where k is one
    number for both; ok is False for anything else (another structure, a constant that is no such function)."""
    if e1 is None or e2 is None:
        return e1 is None and e2 is None, e1
    out = _walk(e1, e2, lambda c1, c2: _heads_const(c1, c2, heads1, heads2))
    return out is not None, out if out is not None else e1


def _heads_const(a: int | float, b: int | float, h1: tuple[int, int], h2: tuple[int, int]) -> Expr | None:
    for name, x1, x2 in (("Hq", h1[0], h2[0]), ("Hkv", h1[1], h2[1])):
        if a == x1 and b == x2:
            return var(name)
        if isinstance(a, float) and math.isclose(a / x1, b / x2, rel_tol=1e-9):
            return const(a / x1) * var(name)
        if isinstance(a, float) and math.isclose(a * x1, b * x2, rel_tol=1e-9):
            return const(a * x1) / var(name)
    return None


def generalize_sizes(e1: Expr | None, e2: Expr | None, sizes1: dict[str, int], sizes2: dict[str, int]) -> tuple[bool, Expr | None]:
    """(ok, `e1` with constants written in table sizes) from `e2`, traced with a constructor argument changed: a
    relative-position table `pos_bias[h, q_idx - kv_idx + (max_len - 1)]` of 2 * max_len - 1 columns traces to
    `+ 143` at max_len=144 and `+ 144` at 145, where the table has 287 and 289 columns: the constant is
    `(pos_bias_n1 - 1) // 2`, read from the table the kernel is given. `sizes` maps the dims of the tables (named as
    generate.target names a table position no index variable implies) to their sizes in each trace; a constant
    that moves is `(p * size + r) // q` for p in +-1, +-2 and q in 1, 2, else ok is False."""
    if e1 is None or e2 is None:
        return e1 is None and e2 is None, e1
    free = _unimplied_positions(e1)
    moved = {n: (sizes1[n], sizes2[n]) for n in sizes1 if n in sizes2 and sizes1[n] != sizes2[n] and n in free}
    out = _walk(e1, e2, lambda c1, c2: _size_expr(c1, c2, moved) if isinstance(c1, int) and isinstance(c2, int) else None)
    return out is not None, out if out is not None else e1


def _unimplied_positions(e: Expr) -> set[str]:
    """`{tensor}_n{i}` for each table position that every load of `e` indexes with something other than one of
    b, h, q_idx, kv_idx: the positions generate.target gives a dim of their own, bound from the table at run time."""
    bare: set[str] = set()
    other: set[str] = set()
    for node in walk(e):
        if node.op is ExprOp.LOAD:
            for i, ix in enumerate(node.args):
                name = f"{node.value}_n{i}"
                (bare if ix.op is ExprOp.VAR and ix.value in ("b", "h", "q_idx", "kv_idx") else other).add(name)
    return other - bare


def _size_expr(c1: int, c2: int, moved: dict[str, tuple[int, int]]) -> Expr | None:
    for name, (n1, n2) in moved.items():
        for q in (1, 2):
            for p in (1, -1, 2, -2):
                for r in range(q * c1 - p * n1, q * c1 - p * n1 + q):
                    if (p * n1 + r) // q == c1 and (p * n2 + r) // q == c2:
                        e = var(name) if p == 1 else var(name) * p
                        e = e if r == 0 else e + r if r > 0 else e - abs(r)
                        return e if q == 1 else Expr(ExprOp.FLOORDIV, (e, const(q)))
    return None
