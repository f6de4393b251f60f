"""What a Triton backward kernel computes, read off its tile dataflow (`ingest.triton_tiles`, `ingest.triton_grad`).

Three kinds of kernels, each recognised by what it stores, never by its name:
- a **delta kernel** stores a row sum over the head dim of the product of two loaded tiles (o * dO);
- a **KV-outer kernel** stores dV (a loop accumulating Pᵀ·dO over q blocks) and dK (dSᵀ·Q over the same
  loops); dQ = dS·K is added per q block (`tl.atomic_add`, or load-add-store), or left to a dQ pass;
- a **dQ pass** stores dQ accumulated over a loop over KV blocks (dS·K), recomputing P and dS.
Loops around the stores (a serial loop over KV blocks, the q heads of a GQA group) are kept as `outer`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kb.ir.expr import Expr, const
from ingest.triton_grad import (
    Probs, Refuse, SoftmaxGrad, Term, accumulation, contraction, linear, probs, product, same_load, softmax_grad,
)
from kb.ir.algebra import normal_form
from ingest.triton_tiles import TV, EarlyExit, Effect, LoopNode, TileWalk

__all__ = ["QBlockLoop", "KVOuter", "KVBlockLoop", "DQPass", "Delta", "kind_of", "recognise_kv_outer",
           "recognise_dq_pass", "recognise_delta", "effects", "early_exits", "ancestors", "is_probs"]


@dataclass
class QBlockLoop:
    """One loop over q blocks of a KV-outer kernel and the gradient math inside it."""

    loop: LoopNode
    p: Probs
    ds: SoftmaxGrad
    dq: Effect | None  # the dQ update in this loop (None: a separate dQ pass)
    dq_rmw: bool


@dataclass
class KVOuter:
    dk: Effect
    dv: Effect
    outer: tuple[LoopNode, ...]  # loops around the dK/dV stores, outermost first
    loops: list[QBlockLoop]

    @property
    def p(self) -> Probs:
        return self.loops[0].p


@dataclass
class KVBlockLoop:
    loop: LoopNode
    p: Probs
    ds: SoftmaxGrad


@dataclass
class DQPass:
    store: Effect
    outer: tuple[LoopNode, ...]
    loops: list[KVBlockLoop]

    @property
    def p(self) -> Probs:
        return self.loops[0].p


@dataclass
class Delta:
    store: Effect
    o: TV  # the two loaded tiles multiplied (o and dO, in source order)
    g: TV


def effects(items: list, chain: tuple = ()) -> list[tuple[Effect, tuple]]:
    """Every store/atomic with the loops around it (outermost first); early exits are not walked."""
    out: list[tuple[Effect, tuple]] = []
    for it in items:
        if isinstance(it, Effect):
            out.append((it, chain))
        elif isinstance(it, LoopNode):
            out += effects(it.body, chain + (it,))
    return out


def early_exits(items: list) -> list[EarlyExit]:
    out: list[EarlyExit] = []
    for it in items:
        if isinstance(it, EarlyExit):
            out.append(it)
        elif isinstance(it, LoopNode):
            out += early_exits(it.body)
    return out


def ancestors(walk: TileWalk, loop: LoopNode) -> tuple[LoopNode, ...]:
    """The loops around `loop`, outermost first."""
    def find(items: list, chain: tuple) -> tuple | None:
        for it in items:
            if isinstance(it, LoopNode):
                if it is loop:
                    return chain
                got = find(it.body, chain + (it,))
                if got is not None:
                    return got
        return None
    return find(walk.body, ()) or ()


def _nodes(roots: list[TV]) -> list[TV]:
    seen: dict[int, TV] = {}
    stack = list(roots)
    while stack:
        x = stack.pop()
        if id(x) not in seen:
            seen[id(x)] = x
            stack += [a for a in x.args if isinstance(a, TV)]
    return list(seen.values())


def is_probs(x: TV) -> bool:
    try:
        probs(x)
        return True
    except Refuse:
        return False


def kind_of(walk: TileWalk) -> str | None:
    """"backward" when the kernel recomputes probabilities from a loaded log-sum-exp, "delta" for a stored row
    sum of a product of two loads (and no dot), else None."""
    values = [e.value for e, _ in effects(walk.body) if isinstance(e.value, TV)]
    nodes = _nodes(values)
    if any(x.op in ("exp", "exp2") and is_probs(x) for x in nodes):
        return "backward"
    if not any(x.op == "dot" for x in nodes) and any(_delta_value(v) for v in values):
        return "delta"
    return None


def _delta_value(x: TV) -> tuple[TV, TV] | None:
    """`sum(a * b, axis)` over two loaded tiles (a row sum over the head dim): (a, b)."""
    if x.op != "sum" or not isinstance(x.args[0], TV) or x.args[0].op != "mul":
        return None
    a, b = x.args[0].args
    if isinstance(a, TV) and isinstance(b, TV) and a.op == b.op == "load" and a.lanes == b.lanes:
        return a, b
    return None


def recognise_delta(walk: TileWalk) -> Delta:
    found = [(e, pair) for e, _ in effects(walk.body) if isinstance(e.value, TV) and (pair := _delta_value(e.value))]
    if len(found) != 1:
        raise Refuse(f"{len(found)} stores of rowsum(a * b)")
    eff, (a, b) = found[0]
    if a.info[0].base == b.info[0].base:  # type: ignore[index]
        raise Refuse(f"line {eff.line}: the row sum multiplies {a.info[0].base} by itself, not o by dO")  # type: ignore[index]
    return Delta(eff, a, b)


def _check_scale(got: Expr, want: Expr, what: str, line: int) -> None:
    if normal_form(got) != normal_form(want):
        raise Refuse(f"line {line}: {what} is scaled by {got}, the scores by {want}")


def _accumulated(walk: TileWalk) -> list[tuple[Effect, tuple, list[Term], str]]:
    """Stores of accumulated dots, with what each accumulates: "dv" (P·dO), "dk" (dS·Q) or "dq" (dS·K)."""
    out = []
    for eff, chain in effects(walk.body):
        if eff.kind != "store" or not isinstance(eff.value, TV):
            continue
        try:
            terms = accumulation(eff.value)
        except Refuse:
            continue
        c = contraction(terms[0].value) if terms else None
        role = _role(c) if c is not None else None
        if role is not None:
            out.append((eff, chain, terms, role))
    return out


def _role(c) -> str | None:
    for x, other in ((c.a, c.b), (c.b, c.a)):
        if is_probs(x):
            return "dv"
        try:
            ds = softmax_grad(x, probs)
        except Refuse:
            continue
        if c.lane == ds.p.q_lane:
            return "dk"
        if c.lane == ds.p.kv_lane:
            return "dq"
    return None


def recognise_kv_outer(walk: TileWalk) -> KVOuter:
    """The dK and dV accumulations, their q-block loops, P, dS and the dQ update of each loop (if any)."""
    found = {role: (eff, chain, terms) for eff, chain, terms, role in reversed(_accumulated(walk))}
    if "dv" not in found or "dk" not in found:
        missing = "dV (a loop accumulating Pᵀ·dO)" if "dv" not in found else "dK (a loop accumulating dSᵀ·Q)"
        raise Refuse(f"no {missing} is stored")
    (dk, kchain, kterms), (dv, vchain, vterms) = found["dk"], found["dv"]
    if kchain != vchain:
        raise Refuse(f"dK (line {dk.line}) and dV (line {dv.line}) are stored in different loops")
    by_loop = {id(t.loop): t for t in kterms}
    if len(by_loop) != len(vterms) or any(id(t.loop) not in by_loop for t in vterms):
        raise Refuse(f"dK (line {dk.line}) and dV (line {dv.line}) accumulate over different loops")
    loops = [_q_block_loop(t, by_loop[id(t.loop)], walk) for t in vterms]
    if len({ml.dq is None for ml in loops}) > 1:
        raise Refuse("dQ is updated in some q-block loops and not in others")
    return KVOuter(dk, dv, tuple(vchain), loops)


def _q_block_loop(dv_term: Term, dk_term: Term, walk: TileWalk) -> QBlockLoop:
    cv, ck = contraction(dv_term.value), contraction(dk_term.value)
    assert cv is not None and ck is not None
    p_node, g = (cv.a, cv.b) if is_probs(cv.a) else (cv.b, cv.a)
    p = probs(p_node)
    if g.op != "load" or cv.lane != p.q_lane or p.d_lane not in g.lanes:
        raise Refuse(f"line {cv.node.line}: dV does not contract P with a loaded dO tile over the q rows")
    ds_node, q2 = (ck.a, ck.b) if ck.b.op == "load" else (ck.b, ck.a)
    ds = softmax_grad(ds_node, probs)
    if not same_load(q2, p.q) or ck.lane != p.q_lane:
        raise Refuse(f"line {ck.node.line}: dK does not contract dS with the score's q tile over the q rows")
    if not same_load(ds.dout, g):
        raise Refuse(f"line {ds.line}: dP reads a different tile than the dO of dV (line {cv.node.line})")
    if not (same_load(ds.p.q, p.q) and same_load(ds.p.k, p.k) and same_load(ds.p.lse, p.lse)):
        raise Refuse(f"line {ds.line}: dS recomputes P from other tiles than dV's P")
    _check_scale(product([dv_term.scale, cv.scale]), const(1), "dV", cv.node.line)
    _check_scale(product([dk_term.scale, ck.scale, ds.scale]), p.scale, "dK", ck.node.line)
    dq = _dq_update(dv_term.loop, ds, p, walk)
    if dq is None:
        return QBlockLoop(dv_term.loop, p, ds, None, False)
    eff, rmw, scale = dq
    _check_scale(scale, p.scale, "dQ", eff.line)
    return QBlockLoop(dv_term.loop, p, ds, eff, rmw)


def _dq_update(loop: LoopNode, ds: SoftmaxGrad, p: Probs, walk: TileWalk) -> tuple[Effect, bool, Expr] | None:
    """dQ += dS·K in this loop: `tl.atomic_add(ptr, dot)` or `store(ptr, load(ptr) + dot)`; None without one."""
    for eff in (it for it in loop.body if isinstance(it, Effect)):
        if not isinstance(eff.value, TV):
            continue
        value, rmw, extra = eff.value, False, const(1)
        if eff.kind == "store":
            parts = linear(eff.value)
            own = [t for c, t in parts if isinstance(t, TV) and t.op == "load" and t.info[0].base == eff.ptr.base  # type: ignore[index]
                   and normal_form(t.info[0].offset) == normal_form(eff.ptr.offset) and normal_form(c) == const(1)]  # type: ignore[index]
            rest = [(c, t) for c, t in parts if not any(t is o for o in own)]
            if len(own) != 1 or len(rest) != 1 or not isinstance(rest[0][1], TV):
                continue
            value, rmw, extra = rest[0][1], True, rest[0][0]
        c = contraction(value)
        if c is None:
            continue
        k2 = c.b if _same_ds(c.a, ds) else c.a if _same_ds(c.b, ds) else None
        if k2 is None:
            continue
        if not same_load(k2, p.k) or c.lane != p.kv_lane:
            raise Refuse(f"line {c.node.line}: dQ does not contract dS with the score's k tile over the kv rows")
        return eff, rmw, product([extra, c.scale, ds.scale])
    return None


def _same_ds(x: TV, ds: SoftmaxGrad) -> bool:
    if x is ds.node:
        return True
    try:
        other = softmax_grad(x, probs)
    except Refuse:
        return False
    return same_load(other.dout, ds.dout) and same_load(other.delta, ds.delta) and same_load(other.v, ds.v)


def recognise_dq_pass(walk: TileWalk) -> DQPass:
    """dQ accumulated over loops over KV blocks (dS·K with dS recomputed) and stored after them."""
    found = [(eff, chain, terms) for eff, chain, terms, role in _accumulated(walk) if role == "dq"]
    if len(found) != 1:
        raise Refuse(f"{len(found)} stores of dQ accumulated over KV blocks")
    eff, chain, terms = found[0]
    loops = []
    for t in terms:
        c = contraction(t.value)
        assert c is not None
        ds_node, k2 = (c.a, c.b) if c.b.op == "load" else (c.b, c.a)
        ds = softmax_grad(ds_node, probs)
        if not same_load(k2, ds.p.k) or c.lane != ds.p.kv_lane:
            raise Refuse(f"line {c.node.line}: dQ does not contract dS with the score's k tile over the kv rows")
        _check_scale(product([t.scale, c.scale, ds.scale]), ds.p.scale, "dQ", c.node.line)
        loops.append(KVBlockLoop(t.loop, ds.p, ds))
    return DQPass(eff, tuple(chain), loops)
