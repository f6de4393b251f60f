"""Rewriting and building expressions: the one algebra every stage uses.

Three rewrites, each for one job, all value-preserving:
- `simplify`: local exact rewrites of any expression (constant folding, identities, boolean
  normal forms such as `~(a > b)` -> `a <= b`). Spec tracing runs it on traced score/mask mods.
- `tidy_int`: the integer subset (fold int constants, drop +0/-0/*1 and double negation, turn
  `x + -c` into `x - c`). The lowerings run it on generated index math and block tests; it folds
  no comparisons, so a test that is constant for one program is still emitted as written.
- `normal_form`: the polynomial normal form (`to_poly`/`from_poly`), which cancels terms
  (`m * BLOCK_M + (q_idx - m * BLOCK_M)` -> `q_idx`). The Triton lifters run it on index math.

Builders and queries: `conjuncts`/`disjuncts` split a nest of `&`/`|`; `all_of`, `any_of`,
`min_of`, `max_of` fold a list to the left; `FLIP` swaps a comparison's sides and `NEGATE`
negates it; `linear_form` reads `alpha*q_idx + beta*kv_idx + c`; `is_pow2`, `next_pow2`.

Invariant: for every rewrite `r`, `r(e)` evaluates to the value of `e` wherever `e` is defined
(`normal_form` on integer/real arithmetic; floor division, modulo and calls are its atoms).
"""

from __future__ import annotations

import math
from functools import reduce
from typing import Callable

from kb.ir.expr import Expr, ExprOp, call, const, free_vars, number, print_expr, var

__all__ = [
    "SIMPLIFY_RULES", "FLIP", "NEGATE", "is_pow2", "next_pow2", "is_int_const", "conjuncts", "disjuncts", "terms", "all_of", "any_of",
    "conjunction", "min_of", "max_of", "linear_form", "simplify", "tidy_int", "Poly", "to_poly", "from_poly",
    "scale_poly", "normal_form", "normal_compare",
]

# `a op b` == `b FLIP[op] a`
FLIP = {ExprOp.LT: ExprOp.GT, ExprOp.LE: ExprOp.GE, ExprOp.GT: ExprOp.LT, ExprOp.GE: ExprOp.LE,
        ExprOp.EQ: ExprOp.EQ, ExprOp.NE: ExprOp.NE}
# `~(a op b)` == `a NEGATE[op] b`
NEGATE = {ExprOp.LT: ExprOp.GE, ExprOp.LE: ExprOp.GT, ExprOp.GT: ExprOp.LE, ExprOp.GE: ExprOp.LT,
          ExprOp.EQ: ExprOp.NE, ExprOp.NE: ExprOp.EQ}


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_int_const(e: Expr) -> bool:
    return e.op is ExprOp.CONST and isinstance(e.value, int) and not isinstance(e.value, bool)


def _is_num(e: Expr) -> bool:
    return e.op is ExprOp.CONST and isinstance(e.value, (int, float)) and not isinstance(e.value, bool)


def _is_const(e: Expr, *values: object) -> bool:
    """e is a numeric constant equal to one of `values` (1.0 counts as 1; booleans never count)."""
    return _is_num(e) and any(e.value == v for v in values)


def _is_bool(e: Expr, v: bool) -> bool:
    """e is the boolean constant v (not merely == v: 1.0 == True in Python)."""
    return e.op is ExprOp.CONST and isinstance(e.value, bool) and e.value is v


# ---------------------------------------------------------------- splitting and building


def terms(e: Expr, op: ExprOp) -> list[Expr]:
    """The operands of a nest of `op` in order (AND: conjuncts, OR: disjuncts); [e] if `e` is no `op`."""
    if e.op is op:
        return [t for a in e.args for t in terms(a, op)]
    return [e]


def conjuncts(e: Expr) -> list[Expr]:
    """Top-level `&` terms of `e` (a single term if `e` is not a conjunction)."""
    return terms(e, ExprOp.AND)


def disjuncts(e: Expr) -> list[Expr]:
    """Top-level `|` terms of `e`."""
    return terms(e, ExprOp.OR)


def _fold_left(op: ExprOp, es: list[Expr]) -> Expr:
    return reduce(lambda a, b: Expr(op, (a, b)), es)


def all_of(es: list[Expr]) -> Expr:
    """`e0 & e1 & ...` folded to the left (`es` not empty)."""
    return _fold_left(ExprOp.AND, es)


def any_of(es: list[Expr]) -> Expr:
    """`e0 | e1 | ...` folded to the left (`es` not empty)."""
    return _fold_left(ExprOp.OR, es)


def conjunction(es: list[Expr]) -> Expr | None:
    """`all_of(es)`, or None for no terms."""
    return all_of(es) if es else None


def min_of(es: list[Expr]) -> Expr:
    """`minimum(minimum(e0, e1), ...)` (`es` not empty)."""
    return _fold_left(ExprOp.MINIMUM, es)


def max_of(es: list[Expr]) -> Expr:
    """`maximum(maximum(e0, e1), ...)` (`es` not empty)."""
    return _fold_left(ExprOp.MAXIMUM, es)


# ---------------------------------------------------------------- linear forms


def linear_form(e: Expr, x: str = "q_idx", y: str = "kv_idx") -> tuple[int, int, Expr] | None:
    """(alpha, beta, c) with e == alpha*x + beta*y + c, integer alpha/beta and c free of x and y (c may
    load), or None when `e` is not of that form."""
    if not ({x, y} & free_vars(e)):
        return (0, 0, e)
    if e.op is ExprOp.VAR:
        return (1, 0, const(0)) if e.value == x else (0, 1, const(0))
    if e.op in (ExprOp.ADD, ExprOp.SUB):
        a, b = linear_form(e.args[0], x, y), linear_form(e.args[1], x, y)
        if a is None or b is None:
            return None
        sign = 1 if e.op is ExprOp.ADD else -1
        return a[0] + sign * b[0], a[1] + sign * b[1], Expr(e.op, (a[2], b[2]))
    if e.op is ExprOp.NEG:
        a = linear_form(e.args[0], x, y)
        return None if a is None else (-a[0], -a[1], Expr(ExprOp.NEG, (a[2],)))
    if e.op is ExprOp.MUL:
        for k, rest in (e.args, e.args[::-1]):
            if is_int_const(k):
                n, lin = int(number(k)), linear_form(rest, x, y)
                return None if lin is None else (n * lin[0], n * lin[1], k * lin[2])
    return None


# ---------------------------------------------------------------- simplify: exact local rewrites


def _fold(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    if not all(a.op is ExprOp.CONST for a in args):
        return None
    import torch  # noqa: PLC0415  kb.ir stays torch-free: only constant folding needs torch

    from kb.ir.evaluate import eval_expr  # noqa: PLC0415  evaluate imports torch, only constant folding needs it

    try:
        v = eval_expr(Expr(op, args), {})
    except Exception:
        return None
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return const(v)


def simplify(e: Expr) -> Expr:
    """Local rewrites that keep the value exactly: constant folding, identities, boolean
    normal forms (`~(a > b)` -> `a <= b`, `where(c, 1, 0) == 0` -> `~c`): after the arguments are simplified and
    folding found no constant, the first rule of `SIMPLIFY_RULES[e.op]` that applies rewrites `e`."""
    if not e.args:
        return e
    args = tuple(simplify(a) for a in e.args)
    e = Expr(e.op, args, e.value)
    folded = _fold(e.op, args) if e.op is not ExprOp.LOAD else None
    if folded is not None:
        return folded
    for rule in SIMPLIFY_RULES.get(e.op, ()):
        out = rule(e.op, args)
        if out is not None:
            return out
    return e


# ---- the rules: each takes (op, simplified args) and gives the rewritten expression, or None where it does not apply

Rule = Callable[[ExprOp, tuple[Expr, ...]], "Expr | None"]


def _not_not(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    return args[0].args[0] if args[0].op is ExprOp.NOT else None


def _not_comparison(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    return Expr(NEGATE[args[0].op], args[0].args) if args[0].op in NEGATE else None


def _de_morgan(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    """~(a & b) -> ~a | ~b: keeps masks as & of simple terms."""
    (a,) = args
    if a.op not in (ExprOp.AND, ExprOp.OR):
        return None
    inv = ExprOp.OR if a.op is ExprOp.AND else ExprOp.AND
    return simplify(Expr(inv, tuple(~x for x in a.args)))


def _not_const(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    return const(not args[0].value) if args[0].op is ExprOp.CONST else None


def _and_or_units(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    """x & True == x, x | False == x, x & x == x; the other constant absorbs."""
    a, b = args
    unit = op is ExprOp.AND
    if _is_bool(a, unit):
        return b
    if _is_bool(b, unit) or a == b:
        return a
    if _is_bool(a, not unit) or _is_bool(b, not unit):
        return const(not unit)
    return None


def _where_const_condition(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    c, x, y = args
    return (x if c.value else y) if c.op is ExprOp.CONST else None


def _where_same(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    return args[1] if args[1] == args[2] else None


def _where_bool(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    """where(c, True, False) -> c; where(c, False, True) -> ~c."""
    c, x, y = args
    if _is_bool(x, True) and _is_bool(y, False):
        return c
    if _is_bool(x, False) and _is_bool(y, True):
        return simplify(~c)
    return None


def _compare_where_of_constants(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    """where(c, 1, 0) == 0 -> where(c, 1 == 0, 0 == 0), which folds."""
    if args[0].op is not ExprOp.WHERE or args[1].op is not ExprOp.CONST:
        return None
    c, x, y = args[0].args
    if x.op is ExprOp.CONST and y.op is ExprOp.CONST:
        return simplify(call("where", c, Expr(op, (x, args[1])), Expr(op, (y, args[1]))))
    return None


def _compare_same_offset(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    """(x - 1) == (y - 1) -> x == y (ids from offsets)."""
    return simplify(Expr(op, (args[0].args[0], args[1].args[0]))) if _same_int_offset(*args) else None


def _add_zero(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    a, b = args
    return a if _is_const(b, 0) else b if _is_const(a, 0) else None


def _add_negative(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    """a + (-c) -> a - c; a + (-b) -> a - b."""
    a, b = args
    if _is_num(b) and number(b) < 0:
        return a - const(-number(b))
    return a - b.args[0] if b.op is ExprOp.NEG else None


def _offsets(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    """(x + c1) - c2 -> x + (c1 - c2), for + and - on both sides."""
    if not (_is_num(args[1]) and args[0].op in (ExprOp.ADD, ExprOp.SUB) and _is_num(args[0].args[1])):
        return None
    inner, c1 = args[0].args
    total = (number(c1) if args[0].op is ExprOp.ADD else -number(c1)) + (number(args[1]) if op is ExprOp.ADD else -number(args[1]))
    return simplify(inner + total)


def _sub_zero(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    a, b = args
    if _is_const(b, 0):
        return a
    return simplify(-b) if _is_const(a, 0) else None


def _mul_units(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    a, b = args
    if _is_const(b, 1):
        return a
    if _is_const(a, 1):
        return b
    return -b if _is_const(a, -1) else None


def _mul_constants(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    """(a * c1) * c2 -> a * (c1 * c2)."""
    a, b = args
    if b.op is ExprOp.CONST and a.op is ExprOp.MUL and a.args[1].op is ExprOp.CONST:
        return simplify(a.args[0] * (number(a.args[1]) * number(b)))
    return None


def _div_one(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    return args[0] if _is_const(args[1], 1) else None


def _neg_neg(op: ExprOp, args: tuple[Expr, ...]) -> Expr | None:
    return args[0].args[0] if args[0].op is ExprOp.NEG else None


# per operator, the rules in the order they are tried
SIMPLIFY_RULES: dict[ExprOp, tuple[Rule, ...]] = {
    ExprOp.NOT: (_not_not, _not_comparison, _de_morgan, _not_const),
    ExprOp.AND: (_and_or_units,),
    ExprOp.OR: (_and_or_units,),
    ExprOp.WHERE: (_where_const_condition, _where_same, _where_bool),
    ExprOp.EQ: (_compare_where_of_constants, _compare_same_offset),
    ExprOp.NE: (_compare_where_of_constants, _compare_same_offset),
    ExprOp.ADD: (_add_zero, _add_negative, _offsets),
    ExprOp.SUB: (_offsets, _sub_zero),
    ExprOp.MUL: (_mul_units, _mul_constants),
    ExprOp.DIV: (_div_one,),
    ExprOp.NEG: (_neg_neg,),
}


def _same_int_offset(a: Expr, b: Expr) -> bool:
    """`a` and `b` add (or subtract) the same integer constant."""
    return (a.op is b.op and a.op in (ExprOp.ADD, ExprOp.SUB) and a.args[1] == b.args[1]
            and a.args[1].op is ExprOp.CONST and type(a.args[1].value) is int)


# ---------------------------------------------------------------- tidy_int: integer cleanup for generated code


def tidy_int(e: Expr) -> Expr:
    """Fold integer constants and drop +0/-0/double negation (keeps generated conditions readable)."""
    args = tuple(tidy_int(a) for a in e.args)
    e = Expr(e.op, args, e.value) if args else e
    if e.op is ExprOp.NEG:
        (a,) = args
        if is_int_const(a):
            return const(-number(a))
        if a.op is ExprOp.NEG:
            return a.args[0]
        if a.op is ExprOp.SUB:
            return tidy_int(a.args[1] - a.args[0])
    if e.op in (ExprOp.ADD, ExprOp.SUB):
        a, b = args
        if is_int_const(a) and is_int_const(b):
            return const(number(a) + number(b) if e.op is ExprOp.ADD else number(a) - number(b))
        if is_int_const(b) and b.value == 0:
            return a
        if is_int_const(a) and a.value == 0:
            return b if e.op is ExprOp.ADD else tidy_int(Expr(ExprOp.NEG, (b,)))
        if b.op is ExprOp.NEG:
            return tidy_int(Expr(ExprOp.SUB if e.op is ExprOp.ADD else ExprOp.ADD, (a, b.args[0])))
        if is_int_const(b) and number(b) < 0:
            return Expr(ExprOp.SUB if e.op is ExprOp.ADD else ExprOp.ADD, (a, const(-number(b))))
        if is_int_const(b) and a.op in (ExprOp.ADD, ExprOp.SUB) and is_int_const(a.args[1]):
            # (x +- c1) +- c2 -> x + (+-c1 +- c2)
            c = (number(a.args[1]) if a.op is ExprOp.ADD else -number(a.args[1])) \
                + (number(b) if e.op is ExprOp.ADD else -number(b))
            return tidy_int(a.args[0] + c)
    if e.op is ExprOp.MUL:
        a, b = args
        if is_int_const(a) and a.value == 1:
            return b
        if is_int_const(b) and b.value == 1:
            return a
    return e


# ---------------------------------------------------------------- normal_form: polynomials over atoms

Monomial = tuple[Expr, ...]
Poly = dict[Monomial, float | int]

_ARITH = (ExprOp.ADD, ExprOp.SUB, ExprOp.MUL, ExprOp.NEG)


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


def to_poly(e: Expr) -> Poly:
    """`e` expanded into monomials over atoms (variables and non-polynomial nodes such as `cdiv(...)`,
    `abs(...)`, loads, whose arguments are put in normal form)."""
    if _is_num(e):
        return {(): number(e)} if number(e) != 0 else {}
    if e.op is ExprOp.ADD:
        return _add(to_poly(e.args[0]), to_poly(e.args[1]))
    if e.op is ExprOp.SUB:
        return _add(to_poly(e.args[0]), to_poly(e.args[1]), -1)
    if e.op is ExprOp.NEG:
        return scale_poly(to_poly(e.args[0]), -1)
    if e.op is ExprOp.MUL:
        return _mul(to_poly(e.args[0]), to_poly(e.args[1]))
    atom = e if not e.args else Expr(e.op, tuple(normal_form(a) for a in e.args), e.value)
    return {(atom,): 1}


def _mono_expr(m: Monomial) -> Expr:
    if not m:
        return const(1)
    out = m[0]
    for a in m[1:]:
        out = out * a
    return out


def _order(m: Monomial) -> tuple:
    # index variables first, then everything else by text; constants last
    rank = 0 if any(a.op is ExprOp.VAR and a.value in ("q_idx", "kv_idx") for a in m) else 1
    return (len(m) == 0, rank, [_key(a) for a in m])


def from_poly(p: Poly) -> Expr:
    """The expression of `p`: q_idx/kv_idx terms first, constants last, `+`/`-` by each coefficient's sign."""
    if not p:
        return const(0)
    out: Expr | None = None
    for m in sorted(p, key=_order):
        c = p[m]
        mag = abs(c)
        term = const(mag) if not m else (_mono_expr(m) if mag == 1 else mag * _mono_expr(m))
        if out is None:
            out = term if c > 0 else (const(c) if not m else -term)
        else:
            out = Expr(ExprOp.ADD if c > 0 else ExprOp.SUB, (out, term))
    assert out is not None
    return out


def normal_form(e: Expr) -> Expr:
    """Normal form of arithmetic subtrees; other nodes keep their shape with children in normal form."""
    if e.op in _ARITH or (e.op is ExprOp.CONST and not isinstance(e.value, bool)):
        return from_poly(to_poly(e))
    if not e.args:
        return e
    return Expr(e.op, tuple(normal_form(a) for a in e.args), e.value)


def normal_compare(op: ExprOp, lhs: Expr, rhs: Expr) -> Expr:
    """`lhs op rhs` rearranged: positive monomials of lhs - rhs on the left, the rest on the right.

    If q_idx would end up on the right, the comparison is flipped so it reads `q_idx ... kv_idx`.
    """
    d = _add(to_poly(lhs), to_poly(rhs), -1)
    left = {m: c for m, c in d.items() if c > 0}
    right = {m: -c for m, c in d.items() if c < 0}
    q = var("q_idx")

    if any(q in m for m in right) and not any(q in m for m in left):
        left, right, op = right, left, FLIP[op]
    return Expr(op, (from_poly(left), from_poly(right)))
