"""Recognise the attention-gradient math in a tile dataflow (`ingest.triton_tiles`), by what is computed.

Nothing here reads a name. Tiles are matched by the operations that produce them and the lanes
(axes) they span, so transposed formulations (`dsT = pT * (dpT - Di[None, :])`) read the same as
row-major ones:
- a **score** is a `tl.dot` of two loaded tiles contracting their head-dim lane (q rows x kv rows);
- **probabilities** are `exp(c * S - L)` (or `exp2` with log2(e) folded into both terms) with S a score
  (masks `where(cond, S, -inf)` may wrap it; `where(cond, P, 0)` may wrap P), c a scalar (the softmax
  scale) and L a loaded row vector over the q rows (the saved log-sum-exp);
- a **softmax gradient** is P * (dP - Dt) times scalars, with dP a dot of a loaded tile (dO) and a kv
  tile (V) over the head dim, and Dt a loaded row vector (delta);
- an **accumulation** is a value stored after loops whose carried value grows by terms each iteration
  (`dv += tl.dot(...)`), possibly scaled after the loop (`dk *= sm_scale`).
Refusals raise `Refuse` with the line and what was found, so a broken kernel says why it is not a
backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kb.ir.expr import Expr, ExprOp, const, number
from ingest.triton_exec import LOG2E, MASK_FILL
from kb.ir.algebra import from_poly, normal_form, scale_poly, to_poly
from ingest.triton_tiles import TV, LoopNode

__all__ = ["Refuse", "Contraction", "Probs", "SoftmaxGrad", "Term", "contraction", "probs", "softmax_grad",
           "accumulation", "linear", "same_load", "product"]


class Refuse(Exception):
    """The dataflow is not the gradient the lifter recognises; the message says what was found."""


@dataclass(frozen=True)
class Contraction:
    """`tl.dot` of a and b (transposes unwrapped) contracting `lane`, times `scale` (product of scalars)."""

    a: TV
    b: TV
    lane: str
    scale: Expr
    node: TV


@dataclass(frozen=True)
class Probs:
    node: TV  # the outermost node of P (an exp, or a zero-fill where around one)
    q: TV  # the loads of the score dot
    k: TV
    d_lane: str  # the lane the score dot contracts (the head dim)
    lse: TV  # the loaded row vector subtracted in the exponent
    scale: Expr  # what multiplies the scores, in natural-log units
    masks: tuple[Expr, ...]  # conditions a score must meet (source names, tagged lanes)
    terms: tuple[Expr, ...]  # additive score terms over lanes (natural units), e.g. ALiBi
    log2: bool
    line: int

    @property
    def q_lane(self) -> str:
        return next(x for x in self.q.lanes if x != self.d_lane)

    @property
    def kv_lane(self) -> str:
        return next(x for x in self.k.lanes if x != self.d_lane)


@dataclass(frozen=True)
class SoftmaxGrad:
    node: TV
    p: Probs
    dout: TV  # the loaded dO tile of dP = dO V^T
    v: TV
    delta: TV  # the loaded row vector subtracted from dP
    scale: Expr  # scalars multiplying P * (dP - delta)
    line: int


@dataclass(frozen=True)
class Term:
    """One summand an accumulator gains per iteration of `loop`, times `scale` (including later scaling)."""

    value: TV
    loop: LoopNode
    scale: Expr


def _mul(a: Expr, b: Expr) -> Expr:
    return normal_form(a * b)


def product(scalars: list[Expr]) -> Expr:
    out = const(1)
    for s in scalars:
        out = _mul(out, s)
    return out


def _fill(x: object) -> float | None:
    if isinstance(x, Expr) and x.op is ExprOp.CONST and not isinstance(x.value, bool):
        return float(number(x))
    if isinstance(x, Expr) and x.op is ExprOp.NEG and isinstance(x.args[0], Expr):
        v = _fill(x.args[0])
        return None if v is None else -v
    return None


def linear(x: TV | Expr, masks: list[Expr] | None = None) -> list[tuple[Expr, TV | Expr]]:
    """`x` as sum(coef * atom): through add/sub/neg and scalar mul/div; `where(c, t, -inf)` adds c to
    `masks` (when given) and continues into t. Atoms are the other tiles, or lane expressions."""
    if isinstance(x, Expr):
        return [(const(1), x)]
    if x.op == "zeros":  # `qk = tl.zeros(...); qk += tl.dot(...)`
        return []
    if x.op in ("add", "sub"):
        a, b = linear(x.args[0], masks), linear(x.args[1], masks)
        return a + [(_mul(const(-1), c), t) for c, t in b] if x.op == "sub" else a + b
    if x.op == "neg":
        return [(_mul(const(-1), c), t) for c, t in linear(x.args[0], masks)]
    if x.op in ("mul", "div"):
        tiles = [a for a in x.args if isinstance(a, TV)]
        scalar = next((a for a in x.args if isinstance(a, Expr)), None)
        if len(tiles) == 1 and scalar is not None and (x.op == "mul" or x.args[1] is scalar):
            s = scalar if x.op == "mul" else 1 / scalar
            return [(_mul(s, c), t) for c, t in linear(tiles[0], masks)]
    if x.op == "where" and masks is not None and isinstance(x.args[0], TV) and (f := _fill(x.args[1])) is not None \
            and f <= MASK_FILL:
        masks.append(x.info)  # type: ignore[arg-type]
        return linear(x.args[0], masks)
    return [(const(1), x)]


def _strip_scalars(x: TV) -> tuple[TV, list[Expr]]:
    scalars: list[Expr] = []
    while x.op in ("mul", "div") and any(isinstance(a, Expr) for a in x.args) and any(isinstance(a, TV) for a in x.args):
        s = next(a for a in x.args if isinstance(a, Expr))
        if x.op == "div" and x.args[1] is not s:
            break
        scalars.append(s if x.op == "mul" else 1 / s)
        x = next(a for a in x.args if isinstance(a, TV))
    return x, scalars


def _untrans(x: TV) -> TV:
    while x.op == "trans":
        x = x.args[0]
    return x


def contraction(x: TV) -> Contraction | None:
    core, scalars = _strip_scalars(x)
    if core.op != "dot":
        return None
    a, b = core.args
    la = a.lanes[::-1] if core.info[0] else a.lanes  # type: ignore[index]
    return Contraction(_untrans(a), _untrans(b), la[1], product(scalars), core)


def is_load(x: TV) -> bool:
    return x.op == "load"


def same_load(a: TV, b: TV) -> bool:
    """Two loads of the same tensor at the same offsets (the same tile)."""
    if a is b:
        return True
    return is_load(a) and is_load(b) and a.load_ptr().base == b.load_ptr().base \
        and normal_form(a.load_ptr().offset) == normal_form(b.load_ptr().offset)


def _row_vector(x: object) -> bool:
    return isinstance(x, TV) and is_load(x) and len([lane for lane in x.lanes if lane is not None]) == 1


def probs(x: TV) -> Probs:
    """P = exp(scale * S - lse) as recognised in `x`; raises Refuse naming what differs."""
    after: list[Expr] = []
    node = x
    while x.op == "where" and isinstance(x.args[0], TV) and _fill(x.args[1]) == 0.0:
        after.append(x.info)  # type: ignore[arg-type]
        x = x.args[0]
    if x.op not in ("exp", "exp2"):
        raise Refuse(f"line {x.line}: expected exp(...) of the scores, found {x.op}")
    masks: list[Expr] = []
    terms = linear(x.args[0], masks)
    if x.op == "exp2":
        terms = [(normal_form(from_poly(scale_poly(to_poly(c), 1 / LOG2E))), t) for c, t in terms]
    lse = [(c, t) for c, t in terms if _row_vector(t)]
    scores = [(c, t) for c, t in terms if isinstance(t, TV) and not _row_vector(t)]
    extra = [(c, t) for c, t in terms if isinstance(t, Expr)]
    if len(lse) != 1 or normal_form(lse[0][0]) != const(-1):
        raise Refuse(f"line {x.line}: the exponent does not subtract one loaded row vector (the log-sum-exp) "
                     f"in natural units: {[(str(c), getattr(t, 'op', str(t))) for c, t in lse]}")
    if len(scores) != 1:
        raise Refuse(f"line {x.line}: the exponent holds {len(scores)} tile terms besides the log-sum-exp")
    scale, s = scores[0]
    inner: list[Expr] = []
    s_terms = linear(s, inner)
    dots = [(c, t) for c, t in s_terms if isinstance(t, TV)]
    if len(dots) != 1:
        raise Refuse(f"line {x.line}: the scores are not one tl.dot")
    c = contraction(dots[0][1])
    if c is None or not (is_load(c.a) and is_load(c.b)):
        raise Refuse(f"line {x.line}: the scores are not a tl.dot of two loaded tiles")
    row = next(lane for lane in lse[0][1].lanes if lane is not None)  # type: ignore[union-attr]
    q, k = (c.a, c.b) if row in c.a.lanes else (c.b, c.a)
    if row not in q.lanes or row in k.lanes or c.lane in (row,):
        raise Refuse(f"line {x.line}: the log-sum-exp's rows are not the rows of one score operand")
    total = _mul(_mul(scale, dots[0][0]), c.scale)
    extra += [(_mul(scale, cc), t) for cc, t in s_terms if isinstance(t, Expr)]
    return Probs(node, q, k, c.lane, lse[0][1], total, tuple(masks + inner + after),  # type: ignore[arg-type]
                 tuple(normal_form(_mul(cc, t)) for cc, t in extra), x.op == "exp2", x.line)


def softmax_grad(x: TV, p_of: Callable[[TV], Probs]) -> SoftmaxGrad:
    """dS = P * (dP - delta) * scalars, with P recognised by `p_of`; raises Refuse. A zero fill
    `where(mask, dS, 0)` is P's mask again (P is 0 there) and is looked through."""
    node = x
    while x.op == "where" and isinstance(x.args[0], TV) and _fill(x.args[1]) == 0.0:
        x = x.args[0]
    tiles, scalars = _factors(x)
    if len(tiles) != 2:
        raise Refuse(f"line {x.line}: dS is a product of {len(tiles)} tiles, not P * (dP - delta)")
    for p_node, diff in (tiles, tiles[::-1]):
        try:
            p = p_of(p_node)
        except Refuse:
            continue
        terms = linear(diff)
        rows = [(c, t) for c, t in terms if _row_vector(t)]
        dots = [(c, t) for c, t in terms if isinstance(t, TV) and not _row_vector(t)]
        if len(rows) != 1 or len(dots) != 1 or normal_form(rows[0][0]) != const(-1) or len(terms) != 2:
            raise Refuse(f"line {x.line}: dS multiplies P by something other than (dP - delta) with delta a "
                         f"loaded row vector")
        dp = contraction(dots[0][1])
        if dp is None or not (is_load(dp.a) and is_load(dp.b)):
            raise Refuse(f"line {x.line}: dP is not a tl.dot of two loaded tiles")
        dout, v = (dp.a, dp.b) if p.q_lane in dp.a.lanes else (dp.b, dp.a)
        if p.q_lane not in dout.lanes or p.kv_lane not in v.lanes or dp.lane != p.d_lane:
            raise Refuse(f"line {dots[0][1].line}: dP does not contract dO (q rows) with V (kv rows) over the head dim")
        scale = _mul(_mul(product(scalars), dots[0][0]), dp.scale)
        return SoftmaxGrad(node, p, dout, v, rows[0][1], scale, x.line)  # type: ignore[arg-type]
    raise Refuse(f"line {x.line}: neither factor of dS is the recomputed P")


def _factors(x: TV) -> tuple[list[TV], list[Expr]]:
    if x.op == "mul":
        tiles: list[TV] = []
        scalars: list[Expr] = []
        for a in x.args:
            if isinstance(a, Expr):
                scalars.append(a)
            else:
                t, s = _factors(a)
                tiles += t
                scalars += s
        return tiles, scalars
    if x.op == "div" and isinstance(x.args[1], Expr) and isinstance(x.args[0], TV):
        t, s = _factors(x.args[0])
        return t, s + [1 / x.args[1]]

    return [x], []


def accumulation(x: TV) -> list[Term]:
    """The per-iteration summands of a value built by loops (`acc = 0; for ...: acc += t`, also through nested
    loops and loops one after the other), with any scaling applied after the loops; raises Refuse otherwise."""
    core, scalars = _strip_scalars(x)
    post = product(scalars)
    return [Term(t.value, t.loop, _mul(post, t.scale)) for t in _grown(core, None, None)]


def _grown(v: TV, base: TV | None, loop: LoopNode | None) -> list[Term]:
    """The summands that turn `base` (the carried value of `loop`; None: a zero tile) into `v`."""
    if v is base or (base is None and v.op == "zeros"):
        return []
    if v.op == "loop_out":
        carry, final = v.args
        return _grown(carry.args[0], base, loop) + _grown(final, carry, v.info)  # type: ignore[arg-type]
    if loop is None:
        raise Refuse(f"line {v.line}: the stored value is not accumulated over a loop ({v.op})")
    parts = linear(v)
    if len(parts) == 1 and parts[0][1] is v:
        raise Refuse(f"line {v.line}: {v.op} is not the loop's carried value plus tiles")
    own = [(c, t) for c, t in parts if isinstance(t, TV) and _grows(t, base, loop)]
    if len(own) != 1 or normal_form(own[0][0]) != const(1) or any(isinstance(t, Expr) for _, t in parts):
        raise Refuse(f"line {loop.line}: the loop does not add tiles to its carried value")
    terms = [Term(t, loop, c) for c, t in parts if t is not own[0][1]]  # type: ignore[arg-type]
    return _grown(own[0][1], base, loop) + terms


def _grows(t: TV, base: TV | None, loop: LoopNode) -> bool:
    try:
        _grown(t, base, loop)
        return True
    except Refuse:
        return False
