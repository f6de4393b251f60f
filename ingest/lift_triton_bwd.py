"""Lift Triton attention backward kernels into complete backward IR programs (checked against autograd).

`lift_backward(mod, base, family)` looks at every top-level `@triton.jit` kernel of a parsed file
and, by dataflow (`ingest.triton_tiles` walk, `ingest.triton_grad` recognition), sorts out:
- **delta kernels**: a row sum over the head dim of the product of two loaded tiles, stored
  (`delta = rowsum(o * dO)`, FA2's `_bwd_preprocess_do_o_dot`);
- **KV-outer backward kernels**: a value stored after a loop over q blocks that accumulates
  `Pᵀ·dO` (dV) and one that accumulates `dSᵀ·Q` (dK), with P recomputed as exp(scale·QKᵀ - lse)
  and dS = P ∘ (dP - delta), dP = dO·Vᵀ; dQ = dS·K added per q block, by `tl.atomic_add`
  (one program per KV block) or a load-add-store (one program looping over KV blocks).
Each flag combination (causal by the policy, flags by use such as FA2's SEQUENCE_PARALLEL) that
lifts becomes one program in the canonical shape of the backward IR (docs/ir.md, "Backward
programs"): `bwd_preprocess` (delta), `bwd_dkdv` (KV-outer, dq accumulated into an f32 scratch
`dq_acc`), `bwd_dq` (the launcher's copy of dq_acc into dq). Sizes, grid roles, the softmax scale,
the saved log-sum-exp, delta and dO are found by use, never by name. Every program is validated and
run by the reference interpreter against torch autograd (`ingest.lift_verify.verify_backward`).
What does not lift is reported with its reason (a missing idiom and its line).
"""

from __future__ import annotations

import copy
import itertools
import logging
from dataclasses import dataclass, field, replace

from kb.errors import KBError
from kb.ir.expr import Expr, ExprOp, conjunction, const, free_vars, substitute, var
from kb.ir.nodes import (
    Dot, Dtype, Elementwise, For, Full, GridAxis, Init, Kernel, Let, Load, Mask, Param, Probs as ProbsStmt,
    Program, Reduce, Role, Schedule, ScoreMod, ScoreModGrad, SoftmaxGrad as SoftmaxGradStmt, Span, Store,
    VariantFn, MASK_MOD_PARAMS, SCORE_MOD_PARAMS,
)
from ingest.model import LiftedSnippet, LiftedTunable, Provenance
from ingest.triton_exec import stride_indices
from ingest.triton_grad import (
    Probs, Refuse, SoftmaxGrad, accumulation, contraction, linear, probs, product, same_load, softmax_grad,
)
from ingest.triton_source import ENUMERATED_FLAGS, JitFn, TritonModule, Unknown, flag_policy, specialize
from ingest.triton_sym import compare, simplify
from ingest.triton_tiles import TV, EarlyExit, Effect, LoopNode, TileWalk, lanes_of, strip_tags, walk_tiles

__all__ = ["BackwardReport", "lift_backward", "BWD_LIFTER_VERSION"]

log = logging.getLogger(__name__)
BWD_LIFTER_VERSION = "triton-bwd-1"
_BWD_POLICY = {"DEBUG": False}  # debug prints and dumps off (a prefix of the constexpr's name)


@dataclass
class BackwardReport:
    programs: list = field(default_factory=list)  # ingest.lift_triton.LiftedProgram
    snippets: list[LiftedSnippet] = field(default_factory=list)
    tunables: list[LiftedTunable] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    handled: set[str] = field(default_factory=set)  # kernels the forward lifter must leave alone
    coverage: list[tuple[str, str]] = field(default_factory=list)  # (kernel, "lifted: ..." or why not)


# ================================================================ the dataflow of one kernel


@dataclass
class _MLoop:
    """One loop over q blocks of a KV-outer kernel, with the gradient math inside it."""

    loop: LoopNode
    p: Probs
    ds: SoftmaxGrad
    dv_dot: TV
    dk_dot: TV
    dq: Effect
    dq_rmw: bool


@dataclass
class _Grad:
    dk: Effect
    dv: Effect
    scope: list[LoopNode]  # loops around the dk/dv stores (a serial loop over KV blocks), outermost first
    loops: list[_MLoop]

    @property
    def p(self) -> Probs:
        return self.loops[0].p


def _effects(items: list, chain: tuple = ()) -> list[tuple[Effect, tuple]]:
    """Every store/atomic with the loops around it (outermost first); early exits are not walked."""
    out: list[tuple[Effect, tuple]] = []
    for it in items:
        if isinstance(it, Effect):
            out.append((it, chain))
        elif isinstance(it, LoopNode):
            out += _effects(it.body, chain + (it,))
    return out


def _early_exits(items: list) -> list[EarlyExit]:
    out: list[EarlyExit] = []
    for it in items:
        if isinstance(it, EarlyExit):
            out.append(it)
        elif isinstance(it, LoopNode):
            out += _early_exits(it.body)
    return out


def _nodes(roots: list[TV]) -> list[TV]:
    seen: dict[int, TV] = {}
    stack = list(roots)
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen[id(x)] = x
        stack += [a for a in x.args if isinstance(a, TV)]
        if x.op == "where" and isinstance(x.info, TV):
            stack.append(x.info)
    return list(seen.values())


def kind_of(walk: TileWalk) -> str | None:
    """"backward" when the kernel recomputes probabilities from a loaded log-sum-exp and multiplies them
    in a dot, "delta" for a row sum of a product of two loads that is stored, else None."""
    values = [e.value for e, _ in _effects(walk.body) if isinstance(e.value, TV)]
    nodes = _nodes(values)
    for x in nodes:
        if x.op in ("exp", "exp2") and _is_probs(x):
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


def _recognise(walk: TileWalk) -> _Grad:
    """The dK and dV accumulations, their loops, P, dS and the dQ update of each loop."""
    effects = _effects(walk.body)
    dk = dv = None
    for eff, chain in effects:
        if eff.kind != "store" or not isinstance(eff.value, TV):
            continue
        try:
            terms = accumulation(eff.value)
        except Refuse:
            continue
        c = contraction(terms[0].value) if terms else None
        if c is None:
            continue
        role = _accumulated_role(c)
        if role == "dv" and dv is None:
            dv = (eff, chain, terms)
        elif role == "dk" and dk is None:
            dk = (eff, chain, terms)
    if dv is None or dk is None:
        raise Refuse(f"no {'dV (a loop accumulating Pᵀ·dO)' if dv is None else 'dK (a loop accumulating dSᵀ·Q)'} "
                     f"is stored")
    if dv[1] != dk[1]:
        raise Refuse(f"dK (line {dk[0].line}) and dV (line {dv[0].line}) are stored in different loops")
    by_loop = {id(t.loop): t for t in dk[2]}
    loops = [_m_loop(t, by_loop.get(id(t.loop)), effects) for t in dv[2]]
    if len(by_loop) != len(loops):
        raise Refuse(f"dK (line {dk[0].line}) and dV (line {dv[0].line}) accumulate over different loops")
    return _Grad(dk[0], dv[0], list(dv[1]), loops)


def _accumulated_role(c) -> str | None:  # noqa: ANN001 - Contraction
    for x in (c.a, c.b):
        try:
            probs(x)
            return "dv"
        except Refuse:
            pass
        try:
            softmax_grad(x, probs)
            return "dk"
        except Refuse:
            pass
    return None


def _m_loop(dv_term, dk_term, effects) -> _MLoop:  # noqa: ANN001
    if dk_term is None:
        raise Refuse(f"line {dv_term.loop.line}: the loop accumulates dV but not dK")
    cv, ck = contraction(dv_term.value), contraction(dk_term.value)
    p_node, g = (cv.a, cv.b) if _is_probs(cv.a) else (cv.b, cv.a)
    p = probs(p_node)
    if g.op != "load" or cv.lane != p.q_lane or p.d_lane not in g.lanes:
        raise Refuse(f"line {cv.node.line}: dV does not contract P with a loaded dO tile over the q rows")
    ds_node, q2 = (ck.a, ck.b) if q_is_second(ck) else (ck.b, ck.a)
    ds = softmax_grad(ds_node, probs)
    if not same_load(q2, p.q) or ck.lane != p.q_lane:
        raise Refuse(f"line {ck.node.line}: dK does not contract dS with the score's q tile over the q rows")
    if not same_load(ds.dout, g):
        raise Refuse(f"line {ds.line}: dP reads a different tile than the dO of dV (line {cv.node.line})")
    if not (same_load(ds.p.q, p.q) and same_load(ds.p.k, p.k) and same_load(ds.p.lse, p.lse)):
        raise Refuse(f"line {ds.line}: dS recomputes P from other tiles than dV's P")
    _check_scale(simplify(product([dv_term.scale, cv.scale])), const(1), "dV", cv.node.line)
    _check_scale(simplify(product([dk_term.scale, ck.scale, ds.scale])), p.scale, "dK", ck.node.line)
    dq, rmw, dq_scale = _dq_update(dv_term.loop, ds, p, effects)
    _check_scale(dq_scale, p.scale, "dQ", dq.line)
    return _MLoop(dv_term.loop, p, ds, cv.node, ck.node, dq, rmw)


def q_is_second(c) -> bool:  # noqa: ANN001
    return c.b.op == "load"


def _is_probs(x: TV) -> bool:
    try:
        probs(x)
        return True
    except Refuse:
        return False


def _check_scale(got: Expr, want: Expr, what: str, line: int) -> None:
    if simplify(got) != simplify(want):
        raise Refuse(f"line {line}: {what} is scaled by {got}, the scores by {want}")


def _dq_update(loop: LoopNode, ds: SoftmaxGrad, p: Probs, effects) -> tuple[Effect, bool, Expr]:  # noqa: ANN001
    """dQ += dS·K in this loop: `tl.atomic_add(ptr, dot)` or `store(ptr, load(ptr) + dot)`."""
    for eff, chain in effects:
        if not chain or chain[-1] is not loop or not isinstance(eff.value, TV):
            continue
        value, rmw = eff.value, False
        if eff.kind == "store":
            parts = linear(eff.value)
            own = [t for c, t in parts if isinstance(t, TV) and t.op == "load" and t.info[0].base == eff.ptr.base
                   and simplify(t.info[0].offset) == simplify(eff.ptr.offset) and simplify(c) == const(1)]
            rest = [(c, t) for c, t in parts if not any(t is o for o in own)]
            if len(own) != 1 or len(rest) != 1 or not isinstance(rest[0][1], TV):
                continue
            value, rmw, extra = rest[0][1], True, rest[0][0]
        else:
            extra = const(1)
        c = contraction(value)
        if c is None:
            continue
        k2 = c.b if c.a is ds.node or _same_ds(c.a, ds) else c.a if _same_ds(c.b, ds) else None
        if k2 is None:
            continue
        if not same_load(k2, p.k) or c.lane != p.kv_lane:
            raise Refuse(f"line {c.node.line}: dQ does not contract dS with the score's k tile over the kv rows")
        return eff, rmw, simplify(product([extra, c.scale, ds.scale]))
    raise Refuse(f"line {loop.line}: no dQ update (atomic add or load-add-store of dS·K) in the loop over q blocks")


def _same_ds(x: TV, ds: SoftmaxGrad) -> bool:
    if x is ds.node:
        return True
    try:
        other = softmax_grad(x, probs)
    except Refuse:
        return False
    return same_load(other.dout, ds.dout) and same_load(other.delta, ds.delta) and same_load(other.v, ds.v)


# ================================================================ names: source -> IR


@dataclass
class _Names:
    values: dict[Expr, Expr] = field(default_factory=dict)  # source sub-expression -> IR (`pid1 // nheads` -> b)
    names: dict[str, Expr] = field(default_factory=dict)  # source name -> IR expression
    lanes: dict[str, str] = field(default_factory=dict)  # lane -> "q" | "kv" | "d"
    index: set[str] = field(default_factory=set)  # IR scalar names that are index atoms
    src_index: set[str] = field(default_factory=set)  # source index atoms: lanes, block sizes, loop variables

    def ir(self, e: Expr) -> Expr:
        return simplify(substitute(_replace(simplify(e), self.values), self.names))


def _replace(e: Expr, table: dict[Expr, Expr]) -> Expr:
    if e in table:
        return table[e]
    if not e.args:
        return e
    return Expr(e.op, tuple(_replace(a, table) for a in e.args), e.value)


def _fused_roles(names: _Names, walk: TileWalk, offset: Expr) -> None:
    """`pid // X` is the batch and `pid % X` the head of a fused batch*head program id; X is Hq."""
    for _, idx in stride_indices(simplify(offset), _lane_vars(walk)):
        for sub in _subexprs(idx):
            if sub.op in (ExprOp.FLOORDIV, ExprOp.MOD) and sub.args[0].op is ExprOp.VAR \
                    and str(sub.args[0].value).startswith("pid") and sub.args[1].op is ExprOp.VAR:
                pid, count = str(sub.args[0].value), str(sub.args[1].value)
                names.values[Expr(ExprOp.FLOORDIV, (var(pid), var(count)))] = var("b")
                names.values[Expr(ExprOp.MOD, (var(pid), var(count)))] = var("h")
                names.names[pid] = Expr(ExprOp.ADD, (Expr(ExprOp.MUL, (var("b"), var("Hq"))), var("h")))
                names.names[count] = var("Hq")


def _subexprs(e: Expr):  # noqa: ANN202
    yield e
    for a in e.args:
        yield from _subexprs(a)


def _lane_vars(walk: TileWalk) -> set[str]:
    """Index atoms of source offsets: lanes (tagged or not), their extents (block sizes), loop variables."""
    extents = {str(e.value) for e in walk.lanes.values() if e.op is ExprOp.VAR}
    return {f"{lane}@{i}" for lane in walk.lanes for i in (0, 1)} | set(walk.lanes) | extents | _loop_vars(walk.body)


def _loop_vars(items: list) -> set[str]:
    return {v for it in items if isinstance(it, LoopNode) for v in {it.var} | _loop_vars(it.body)}


def _whole_roles(names: _Names, walk: TileWalk, q_off: Expr, k_off: Expr) -> None:
    """Whole program ids in both the q and the k pointer (no lane): the batch and the head (no GQA);
    a stride named like `*b`/`*z` is the batch hint, then the lower program id."""
    def pids(off: Expr) -> dict[str, str]:
        out = {}
        for stride, idx in stride_indices(simplify(off), _lane_vars(walk)):
            if idx.op is ExprOp.VAR and str(idx.value).startswith("pid"):
                out[str(idx.value)] = stride
        return out
    qp, kp = pids(q_off), pids(k_off)
    both = sorted(set(qp) & set(kp) - set(names.names))
    if set(qp) - set(kp) - set(names.names) or set(kp) - set(qp) - set(names.names) - set(_kv_pids(walk, k_off)):
        raise Refuse(f"q and k are indexed by different program ids ({sorted(qp)} / {sorted(kp)}): GQA or a head "
                     f"mapping the lifter does not read")
    free = [r for r in ("b", "h") if var(r) not in names.values.values()]
    by_hint = sorted(both, key=lambda pid: (qp[pid][-1:] not in ("b", "z"), pid))
    for pid, role in zip(by_hint, free):
        names.names[pid] = var(role)


def _kv_pids(walk: TileWalk, k_off: Expr) -> list[str]:
    return [v for _, idx in stride_indices(simplify(k_off), _lane_vars(walk)) if lanes_of(idx)
            for v in free_vars(idx) if v.startswith("pid")]


def _sizes(names: _Names, walk: TileWalk) -> None:
    """M, N, D: the scalar parameters that alone bound the q-row, kv-row and head-dim lanes."""
    found: dict[str, set[str]] = {}
    for c in walk.compares:
        c = strip_tags(c)
        for side, other in ((c.args[0], c.args[1]), (c.args[1], c.args[0])):
            if other.op is ExprOp.VAR and str(other.value) in walk.scalars and len(lanes_of(side)) == 1 \
                    and not lanes_of(other):
                found.setdefault(names.lanes.get(next(iter(lanes_of(side))), "?"), set()).add(str(other.value))
    for kind, dim in (("q", "M"), ("kv", "N"), ("d", "D")):
        params = found.get(kind, set())
        if len(params) > 1:
            raise Refuse(f"the {dim} lane is bounded by several parameters: {sorted(params)}")
        if params:
            names.names[params.pop()] = var(dim)


_LANE_CONSTS = {"q": "BLOCK_M", "kv": "BLOCK_N", "d": "HEAD_PAD"}


def _lane_roles(names: _Names, walk: TileWalk, p: Probs) -> None:
    for lane, kind in ((p.q_lane, "q"), (p.kv_lane, "kv"), (p.d_lane, "d")):
        names.lanes[lane] = kind
        extent = walk.lanes[lane]
        if extent.op is ExprOp.VAR:
            names.names[str(extent.value)] = var(_LANE_CONSTS[kind])
        elif kind != "d":
            raise Refuse(f"the {kind} tile extent {extent} is not a block-size parameter")


# ================================================================ IR indices


def _index(names: _Names, off: Expr, tensor: str, head: str, rows: str, d: bool = True) -> tuple:
    """The IR index of a tile load/store at source offset `off`: [b, head, rows:+BLOCK(, :)]."""
    ir = names.ir(off)
    found: dict[str, object] = {}
    for stride, idx in stride_indices(ir, names.index | _lane_vars_of(ir)):
        plain = strip_tags(idx)
        lanes = {names.lanes.get(lane) for lane in lanes_of(plain)}
        if lanes == {"d"} and plain.op is ExprOp.VAR:
            found["d"] = Full()
        elif lanes and lanes <= {"q", "kv"} and len(lanes) == 1:
            (kind,) = lanes
            lane = next(iter(lanes_of(plain)))
            start = simplify(Expr(ExprOp.SUB, (plain, var(lane))))
            if lanes_of(start):
                raise Refuse(f"{tensor}: row index {plain} is not a start plus one lane")
            found["rows" if kind == rows else "other_rows"] = Span(start, _LANE_CONSTS[kind])
        elif idx == var("b"):
            found["b"] = idx
        elif free_vars(idx) and free_vars(idx) <= {"h", "hk"}:
            found["head"] = idx
        elif idx != const(0):
            raise Refuse(f"{tensor}: offset term {idx} (stride {stride or 1}) is not the batch, head, rows or head dim")
    want = ["b", "head", "rows"] + (["d"] if d else [])
    missing = [w for w in want if w not in found] + (["(unexpected rows)"] if "other_rows" in found else [])
    if missing:
        raise Refuse(f"{tensor}: offset {ir} has no {', '.join(missing)} term")
    if found["head"] != var(head):
        raise Refuse(f"{tensor}: head index {found['head']}, expected {head}")
    return tuple(found[w] for w in want)


def _lane_vars_of(e: Expr) -> set[str]:
    return {v for v in free_vars(e) if v.startswith("_l_")}


def _tile_index(names: _Names, t: TV, tensor: str, head: str, rows: str, d: bool = True) -> tuple:
    return _index(names, t.info[0].offset, tensor, head, rows, d)  # type: ignore[index]


# ================================================================ assembly


@dataclass
class _Built:
    program: Program
    notes: list[str]
    spans: list[tuple[str, str, int, int, str]]  # (snippet kind, ir text, start, end, file)


_PARAMS = (
    Param("q", ("B", "Hq", "M", "D"), Dtype.F16, Role.IN), Param("k", ("B", "Hkv", "N", "D"), Dtype.F16, Role.IN),
    Param("v", ("B", "Hkv", "N", "D"), Dtype.F16, Role.IN), Param("o", ("B", "Hq", "M", "D"), Dtype.F16, Role.IN),
    Param("dout", ("B", "Hq", "M", "D"), Dtype.F16, Role.IN), Param("lse", ("B", "Hq", "M"), Dtype.F32, Role.IN),
    Param("dq", ("B", "Hq", "M", "D"), Dtype.F16, Role.OUT), Param("dk", ("B", "Hkv", "N", "D"), Dtype.F16, Role.OUT),
    Param("dv", ("B", "Hkv", "N", "D"), Dtype.F16, Role.OUT), Param("delta", ("B", "Hq", "M"), Dtype.F32, Role.SCRATCH),
    Param("dq_acc", ("B", "Hq", "M", "D"), Dtype.F32, Role.SCRATCH), Param("sm_scale", (), Dtype.F32, Role.SCALAR),
)


def _kv_axis(names: _Names, g: _Grad) -> tuple[tuple[GridAxis, ...], LoopNode | None]:
    """The KV block: a program id (one program per KV block) or the loop around the dk/dv stores."""
    k_off = g.p.k.info[0].offset  # type: ignore[index]
    starts = [simplify(Expr(ExprOp.SUB, (strip_tags(idx), var(lane))))
              for _, idx in stride_indices(simplify(k_off), names.src_index)
              for lane in lanes_of(strip_tags(idx)) if names.lanes.get(lane) == "kv"]
    if len(starts) != 1:
        raise Refuse(f"the k tile has {len(starts)} row terms")
    start = starts[0]
    pids = sorted(v for v in free_vars(start) if v.startswith("pid") and v not in names.names)
    serial = [lp for lp in g.scope if lp.var in free_vars(start)]
    if len(pids) == 1 and not serial:
        names.names[pids[0]] = var("n")
        axis: tuple[GridAxis, ...] = (GridAxis("n", Expr(ExprOp.CDIV, (var("N"), var("BLOCK_N")))),)
        loop = None
    elif len(serial) == 1 and not pids and len(g.scope) == 1:
        names.names[serial[0].var] = var("n")
        names.index.add(serial[0].var)
        axis, loop = (), serial[0]
    else:
        raise Refuse(f"the KV block start {start} is neither one program id nor one loop variable")
    if names.ir(start) != simplify(Expr(ExprOp.MUL, (var("n"), var("BLOCK_N")))):
        raise Refuse(f"the KV block start {names.ir(start)} is not n * BLOCK_N")
    if loop is not None and (names.ir(loop.lo) != const(0) or names.ir(loop.step) != const(1)
                             or names.ir(loop.hi) != Expr(ExprOp.CDIV, (var("N"), var("BLOCK_N")))):
        raise Refuse(f"line {loop.line}: the loop over KV blocks is not range(0, cdiv(N, BLOCK_N))")
    return axis, loop


def _positions(names: _Names, ml: _MLoop, e: Expr) -> Expr:
    """`e` (source, over lanes) in absolute positions: lane = q_idx - (q tile start), kv_idx - (k tile start)."""
    at = {}
    for t, pos in ((ml.p.q, "q_idx"), (ml.p.k, "kv_idx")):
        start, lane = _row_start(t, names, {ml.loop.var} | set(names.index))
        at[lane] = Expr(ExprOp.SUB, (var(pos), start))
    return names.ir(simplify(substitute(strip_tags(e), at)))


def _row_start(t: TV, names: _Names, loop_vars: set[str]) -> tuple[Expr, str]:
    """(start, lane) of the row term of a tile's source offset (its lane that is not the head dim)."""
    off = simplify(t.info[0].offset)  # type: ignore[index]
    for _, idx in stride_indices(off, names.src_index | loop_vars):
        plain = strip_tags(idx)
        rows = [lane for lane in lanes_of(plain) if names.lanes.get(lane) in ("q", "kv")]
        if rows:
            return simplify(Expr(ExprOp.SUB, (plain, var(rows[0])))), rows[0]
    raise Refuse(f"line {t.line}: the tile has no row term")


def _mask_terms(names: _Names, ml: _MLoop, notes: list[str]) -> list[Expr]:
    """mask_mod terms from the masks on the scores; kv_idx < N bounds are the IR's own."""
    out: list[Expr] = []
    for cond in ml.p.masks:
        for c in _conjuncts(_positions(names, ml, cond)):
            c = compare(c.op, c.args[0], c.args[1]) if c.op in (ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE) else c
            fv = free_vars(c)
            if "q_idx" in fv:
                bad = fv - {"q_idx", "kv_idx", "b", "h", "M", "N", "D", "Hq", "Hkv"}
                if bad:
                    raise Refuse(f"mask {c} uses names the IR cannot bind: {sorted(bad)}")
                if c not in out:
                    out.append(c)
            elif c == compare(ExprOp.LT, var("kv_idx"), var("N")):
                continue
            else:
                raise Refuse(f"mask {c} on the scores is neither a mask_mod term nor the kv_idx < N bound")
    return out


def _conjuncts(e: Expr) -> list[Expr]:
    if e.op is ExprOp.AND:
        return _conjuncts(e.args[0]) + _conjuncts(e.args[1])
    return [e]


def _score_terms(names: _Names, ml: _MLoop) -> list[Expr]:
    out = []
    for t in ml.p.terms:
        ir = _positions(names, ml, t)
        bad = free_vars(ir) - {"q_idx", "kv_idx", "b", "h", "M", "N", "Hq", "Hkv"}
        if bad:
            raise Refuse(f"score term {ir} uses names the IR cannot bind: {sorted(bad)}")
        out.append(ir)
    return out


def _m_loop_ir(names: _Names, ml: _MLoop, masked: bool, scored: bool, notes: list[str]) -> For:
    lv = ml.loop.var
    q_src, _ = _row_start(ml.p.q, names, {lv})
    loop_var = "m_start" if q_src == var(lv) else "mi"
    names.names[lv] = var(loop_var)
    q_start = names.ir(q_src)
    step = names.ir(ml.loop.step)
    step_dim = "BLOCK_M" if step == var("BLOCK_M") else int(step.value) if step.op is ExprOp.CONST else None  # type: ignore[arg-type]
    if step_dim is None:
        raise Refuse(f"line {ml.loop.line}: the q-block loop steps by {step}")
    at = (var("b"), var("h"), var("m_start"), var("n_start"))
    s = "sm" if scored else "s"
    body: list = [] if loop_var == "m_start" else [Let("m_start", q_start)]
    body += [
        Load("qt", "q", _tile_index(names, ml.p.q, "q", "h", "q")),
        Load("gt", "dout", _tile_index(names, ml.ds.dout, "dout", "h", "q")),
        Load("lt", "lse", _tile_index(names, ml.p.lse, "lse", "h", "q", d=False), other=float("inf")),
        Load("dt", "delta", _tile_index(names, ml.ds.delta, "delta", "h", "q", d=False)),
        Dot("s", "qt", "kt", trans_b=True),
        Elementwise("s", Expr(ExprOp.MUL, (var("s"), var("sm_scale")))),
    ]
    if scored:
        body += [Elementwise("sm", var("s")), ScoreMod("sm", *at)]
    body += [
        Mask(s, *at, use_mask_mod=masked),
        ProbsStmt("p", s, "lt"),
        Dot("dvp", "p", "gt", trans_b=False, trans_a=True),
        Elementwise("dv_acc", Expr(ExprOp.ADD, (var("dv_acc"), var("dvp")))),
        Dot("dp", "gt", "vt", trans_b=True),
        SoftmaxGradStmt("ds", "p", "dp", "dt"),
    ]
    if scored:
        body.append(ScoreModGrad("ds", "s", *at))
    body += [
        Elementwise("ds", Expr(ExprOp.MUL, (var("ds"), var("sm_scale")))),
        Dot("dkp", "ds", "qt", trans_b=False, trans_a=True),
        Elementwise("dk_acc", Expr(ExprOp.ADD, (var("dk_acc"), var("dkp")))),
        Dot("dqp", "ds", "kt", trans_b=False),
        Store("dq_acc", _index(names, ml.dq.ptr.offset, "dq_acc", "h", "q"), "dqp", accumulate=True),
    ]
    return For(loop_var, names.ir(ml.loop.lo), names.ir(ml.loop.hi), step_dim, "forward", tuple(body))


def _dkdv_kernel(names: _Names, g: _Grad, kv: tuple, masked: bool, scored: bool, notes: list[str]) -> Kernel:
    axis, serial = kv
    names.index |= {"n", "n_start", "m_start", "mi", "b", "h", "hk"}
    kv_rows = _tile_index(names, g.p.k, "k", "h", "kv")
    kv_rows = kv_rows[:2] + (Span(var("n_start"), "BLOCK_N"),) + kv_rows[3:]  # n * BLOCK_N, checked by _kv_axis
    for t, name in ((g.loops[0].ds.v, "v"),):
        if _tile_index(names, t, name, "h", "kv") != _tile_index(names, g.p.k, "k", "h", "kv"):
            raise Refuse(f"{name} rows differ from k's")
    scope: list = [
        Let("n_start", Expr(ExprOp.MUL, (var("n"), var("BLOCK_N")))),
        Load("kt", "k", _with_head(kv_rows, "hk")),
        Load("vt", "v", _with_head(kv_rows, "hk")),
        Init("dk_acc", ("BLOCK_N", "HEAD_PAD"), 0.0, Dtype.F32),
        Init("dv_acc", ("BLOCK_N", "HEAD_PAD"), 0.0, Dtype.F32),
    ]
    scope += [_m_loop_ir(names, ml, masked, scored, notes) for ml in g.loops]
    for eff, name in ((g.dk, "dk"), (g.dv, "dv")):
        if _index(names, eff.ptr.offset, name, "h", "kv") != _tile_index(names, g.p.k, "k", "h", "kv"):
            raise Refuse(f"line {eff.line}: {name} is stored at other rows than k is loaded from")
    scope += [Store("dk", _with_head(kv_rows, "hk"), "dk_acc"), Store("dv", _with_head(kv_rows, "hk"), "dv_acc")]
    grid = (GridAxis("b", var("B")), GridAxis("h", var("Hq"))) + axis
    body: list = [Let("hk", var("h"))]
    if serial is None:
        body += scope
    else:
        body.append(For("n", const(0), Expr(ExprOp.CDIV, (var("N"), var("BLOCK_N"))), 1, "forward", tuple(scope)))
        notes.append(f"line {serial.line}: one program per (b, h) loops over the KV blocks and adds dS·K into dq by "
                     f"load-add-store (no atomics): the IR's `store dq_acc[...] += ...` in that loop")
    return Kernel("bwd_dkdv", grid, tuple(body))


def _with_head(index: tuple, head: str) -> tuple:
    return (index[0], var(head)) + index[2:]


def _preprocess_kernel(pre: "_Delta") -> Kernel:
    idx = pre.index
    return Kernel("bwd_preprocess", (GridAxis("b", var("B")), GridAxis("h", var("Hq")),
                                     GridAxis("m", Expr(ExprOp.CDIV, (var("M"), var("BLOCK_M"))))), (
        Let("m_start", Expr(ExprOp.MUL, (var("m"), var("BLOCK_M")))),
        Load("ot", "o", idx),
        Load("gt", "dout", idx),
        Elementwise("og", Expr(ExprOp.MUL, (var("ot"), var("gt")))),
        Reduce("dt", "sum", "og", 1),
        Store("delta", idx[:3], "dt"),
    ))


def _convert_kernel() -> Kernel:
    idx = (var("b"), var("h"), Span(var("m_start"), "BLOCK_M"), Full())
    return Kernel("bwd_dq", (GridAxis("b", var("B")), GridAxis("h", var("Hq")),
                             GridAxis("m", Expr(ExprOp.CDIV, (var("M"), var("BLOCK_M"))))), (
        Let("m_start", Expr(ExprOp.MUL, (var("m"), var("BLOCK_M")))),
        Load("dqt", "dq_acc", idx),
        Store("dq", idx, "dqt"),
    ))


# ================================================================ delta kernels


@dataclass
class _Delta:
    fn: JitFn
    index: tuple  # [b, h, m_start:+BLOCK_M, :] of o and dO
    stored: str  # the parameter delta is stored to
    operands: tuple[str, str]  # the two pointer params multiplied
    lines: tuple[int, int]


def _delta_kernel(walk: TileWalk, fn: JitFn) -> _Delta:
    stores = [(e, _delta_value(e.value)) for e, _ in _effects(walk.body) if isinstance(e.value, TV)]
    found = [(e, pair) for e, pair in stores if pair is not None]
    if len(found) != 1:
        raise Refuse(f"{len(found)} stores of rowsum(a * b)")
    eff, (a, b) = found[0]
    if a.info[0].base == b.info[0].base:  # type: ignore[index]
        raise Refuse(f"line {eff.line}: the row sum multiplies {a.info[0].base} by itself, not o by dO")  # type: ignore[index]
    names = _Names(src_index=_lane_vars(walk))
    _fused_roles(names, walk, a.info[0].offset)
    _whole_roles(names, walk, a.info[0].offset, a.info[0].offset)
    lane_d = next(lane for lane in a.lanes if lane not in eff.value.lanes)
    lane_q = eff.value.lanes[0]
    names.lanes = {lane_q: "q", lane_d: "d"}
    for lane, kind in names.lanes.items():
        if walk.lanes[lane].op is ExprOp.VAR:
            names.names[str(walk.lanes[lane].value)] = var(_LANE_CONSTS[kind])
    starts = [simplify(Expr(ExprOp.SUB, (strip_tags(i), var(lane_q)))) for _, i in
              stride_indices(simplify(a.info[0].offset), _lane_vars(walk)) if lane_q in lanes_of(strip_tags(i))]
    pids = sorted(v for s in starts for v in free_vars(s) if v.startswith("pid") and v not in names.names)
    if len(pids) != 1:
        raise Refuse(f"the row block of the delta kernel is not one program id ({starts})")
    names.names[pids[0]] = var("m")
    _sizes(names, walk)
    names.index |= {"m", "b", "h"}
    idx = _index(names, a.info[0].offset, "o", "h", "q")
    if _index(names, b.info[0].offset, "dout", "h", "q") != idx:
        raise Refuse("o and dO tiles are read at different offsets")
    if idx[2] != Span(Expr(ExprOp.MUL, (var("BLOCK_M"), var("m"))), "BLOCK_M") and \
            idx[2] != Span(simplify(Expr(ExprOp.MUL, (var("m"), var("BLOCK_M")))), "BLOCK_M"):
        raise Refuse(f"the delta kernel's rows {idx[2]} are not m * BLOCK_M + lane")
    if _index(names, eff.ptr.offset, "delta", "h", "q", d=False) != idx[:3]:
        raise Refuse("delta is stored at other rows than o is read")
    idx = (idx[0], idx[1], Span(var("m_start"), "BLOCK_M"), idx[3])
    return _Delta(fn, idx, eff.ptr.base, (a.info[0].base, b.info[0].base), (a.line, eff.line))


# ================================================================ driver


def _flags(fn: JitFn, mod: TritonModule) -> tuple[dict[str, object], list[str]]:
    from ingest.lift_triton import flag_values

    fixed, enumerated = flag_values(fn, mod)
    for n in fn.constexprs:
        if any(n.startswith(p) for p in _BWD_POLICY):
            fixed[n] = next(v for p, v in _BWD_POLICY.items() if n.startswith(p))
    return fixed, [e for e in enumerated if e not in fixed]


def _walk(mod: TritonModule, fn: JitFn, consts: dict[str, object]) -> TileWalk:
    body = specialize(copy.deepcopy(fn.node.body), dict(consts), mod, calls=True)
    return walk_tiles(mod, fn, body, consts)


def _top_kernels(mod: TritonModule) -> list[JitFn]:
    import ast

    called = {n.func.id for f in mod.jit.values() for n in ast.walk(f.node)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return [fn for fn in mod.jit.values() if fn.name not in called]


def lift_backward(mod: TritonModule, base: Provenance, family: str) -> BackwardReport:
    """Backward and delta kernels of `mod`, recognised by dataflow; the rest is left to the forward lifter."""
    rep = BackwardReport()
    kinds: dict[str, tuple[JitFn, str, TileWalk]] = {}
    for fn in _top_kernels(mod):
        fixed, enumerated = _flags(fn, mod)
        try:
            walk = _walk(mod, fn, {**fixed, **{e: False for e in enumerated}})
        except (RecursionError, KBError, KeyError, ValueError, TypeError, IndexError, Unknown) as err:
            log.debug("tile walk of %s failed: %s", fn.name, err)
            continue
        kind = kind_of(walk)
        if kind is not None:
            kinds[fn.name] = (fn, kind, walk)
            rep.handled.add(fn.name)
    deltas = []
    for fn, kind, walk in kinds.values():
        if kind == "delta":
            try:
                deltas.append(_delta_kernel(walk, fn))
                rep.coverage.append((fn.name, "delta kernel: the bwd_preprocess of the backward programs"))
            except Refuse as why:
                rep.skipped.append((fn.name, f"delta kernel not lifted: {why}"))
                rep.coverage.append((fn.name, f"delta kernel not lifted: {why}"))
    for fn, kind, _ in kinds.values():
        if kind == "backward":
            before, skips = len(rep.programs), len(rep.skipped)
            _lift_kernel(rep, mod, fn, base, family, deltas)
            names = [p.name for p in rep.programs[before:]]
            rep.coverage += [(fn.name, f"lifted: {', '.join(names)}")] if names else []
            rep.coverage += [(what, f"not lifted: {why}") for what, why in rep.skipped if what.startswith(fn.name + "[")
                             and (what, why) not in rep.skipped[:skips]]
    return rep


def _lift_kernel(rep: BackwardReport, mod: TritonModule, fn: JitFn, base: Provenance, family: str,
                 deltas: list[_Delta]) -> None:
    fixed, enumerated = _flags(fn, mod)
    tunables = _tunables(mod, fn, base, family)
    rep.tunables += tunables
    for values in itertools.product((False, True), repeat=len(enumerated)):
        flags = dict(zip(enumerated, values))
        label = ",".join(f"{k}={v}" for k, v in flags.items()) or "default"
        try:
            walk = _walk(mod, fn, {**fixed, **flags})
            if walk.unknown:
                raise Refuse("constructs not understood: " + "; ".join(f"line {ln}: {w}" for ln, w in walk.unknown[:4]))
            if not deltas:
                raise Refuse("no kernel in the file computes delta = rowsum(o * dO)")
            built = _build(mod, fn, walk, deltas, flags, family, tunables)
        except Refuse as why:
            rep.skipped.append((f"{fn.name}[{label}]", str(why)))
            continue
        lifted = _checked(rep, mod, fn, built, flags, label, base, family, tunables)
        if lifted is not None:
            rep.programs.append(lifted)
    from ingest.lift_triton import merge_skips

    mine = [s for s in rep.skipped if s[0].startswith(fn.name + "[")]
    rep.skipped = [s for s in rep.skipped if s not in mine] + merge_skips(fn.name, mine)


def _launch_args(mod: TritonModule, kernel: str) -> dict[str, str] | None:
    """Parameter -> the launcher's variable passed to it (positional plain names), from the first launch site."""
    fn = mod.jit[kernel]
    for site in mod.launches:
        if site.kernel == kernel:
            return {a.arg: name for a, name in zip(fn.node.args.args, site.args) if name is not None}
    return None


def _pick_delta(mod: TritonModule, fn: JitFn, g: _Grad, deltas: list[_Delta], notes: list[str]) -> _Delta:
    """The delta kernel whose stored buffer (and dO operand) the launcher passes to this kernel's delta (and dO)."""
    ml = g.loops[0]
    if ml.ds.delta.info[0].base == ml.p.lse.info[0].base:  # type: ignore[index]
        raise Refuse(f"line {ml.ds.line}: dS subtracts the log-sum-exp ({ml.p.lse.info[0].base}), not delta")  # type: ignore[index]
    here = _launch_args(mod, fn.name)
    for pre in deltas:
        there = _launch_args(mod, pre.fn.name)
        if here is None or there is None:
            continue
        delta_arg = here.get(ml.ds.delta.info[0].base)  # type: ignore[index]
        dout_arg = here.get(ml.ds.dout.info[0].base)  # type: ignore[index]
        if delta_arg is not None and there.get(pre.stored) == delta_arg:
            if dout_arg not in (there.get(pre.operands[0]), there.get(pre.operands[1])):
                raise Refuse(f"the launcher passes {dout_arg} as dO, but {pre.fn.name} multiplies "
                             f"{there.get(pre.operands[0])} and {there.get(pre.operands[1])}")
            notes.append(f"delta kernel {pre.fn.name} linked by its launch: it stores `{delta_arg}`, which "
                         f"{fn.name} reads as delta")
            return pre
    notes.append(f"delta kernel {deltas[0].fn.name} matched by dataflow only (no launches link it to {fn.name})")
    return deltas[0]


def _build(mod: TritonModule, fn: JitFn, walk: TileWalk, deltas: list[_Delta], flags: dict[str, bool], family: str,
           tunables: list[LiftedTunable]) -> _Built:
    g = _recognise(walk)
    notes: list[str] = []
    pre = _pick_delta(mod, fn, g, deltas, notes)
    names = _Names(src_index=_lane_vars(walk))
    _lane_roles(names, walk, g.p)
    q_off, k_off = g.p.q.info[0].offset, g.p.k.info[0].offset  # type: ignore[index]
    _fused_roles(names, walk, q_off)
    _whole_roles(names, walk, q_off, k_off)
    _sizes(names, walk)
    if not _scale_param(names, walk, g.p):
        raise Refuse(f"the scores are scaled by {g.p.scale}, not by one scalar parameter")
    kv = _kv_axis(names, g)
    masks: list[Expr] = []
    scored = any(ml.p.terms for ml in g.loops)
    for ml in g.loops:
        for m in _mask_terms(names, ml, notes):
            if m not in masks:
                masks.append(m)
    score = None
    if scored:
        terms = _score_terms(names, g.loops[0])
        score = var("score")
        for t in terms:
            score = Expr(ExprOp.ADD, (score, t))
    dkdv = _dkdv_kernel(names, g, kv, bool(masks), scored, notes)
    _early_exit_notes(walk, g, notes)
    schedule, sched_note = _schedule(tunables, flags)
    notes.append(sched_note)
    notes += _standard_notes(g, pre)
    name = f"{family}_{fn.name.strip('_')}" + "".join(f"_{k.lower()}" for k, v in flags.items() if v)
    prog = Program(name, _PARAMS, schedule, (_preprocess_kernel(pre), dkdv, _convert_kernel()),
                   score_mod=VariantFn("score_mod", SCORE_MOD_PARAMS, score) if score is not None else None,
                   mask_mod=VariantFn("mask_mod", MASK_MOD_PARAMS, conjunction(masks)) if masks else None)
    return _Built(prog, notes, _spans(g, pre, masks))


def _scale_param(names: _Names, walk: TileWalk, p: Probs) -> bool:
    s = simplify(p.scale)
    if s.op is ExprOp.VAR and str(s.value) in walk.scalars:
        names.names[str(s.value)] = var("sm_scale")
        return True
    return False


def _early_exit_notes(walk: TileWalk, g: _Grad, notes: list[str]) -> None:
    """An early exit must store what the main path stores when its q-block loop is empty: zero dK, dV."""
    for ex in _early_exits(walk.body):
        stored = {e.ptr.base for e in ex.effects}
        if any(not isinstance(e.value, TV) or e.value.op != "zeros" for e in ex.effects) \
                or not stored <= {g.dk.ptr.base, g.dv.ptr.base}:
            raise Refuse(f"lines {ex.line}-{ex.end_line}: an early exit stores something other than zero dK/dV")
        notes.append(f"lines {ex.line}-{ex.end_line}: early exit storing zero dK/dV when the KV block has no q rows "
                     f"to visit; the IR runs the empty q-block loop and stores the zero accumulators")


def _standard_notes(g: _Grad, pre: _Delta) -> list[str]:
    ml = g.loops[0]
    notes = [
        f"delta = rowsum(o * dO) from {pre.fn.name} (lines {pre.fn.node.lineno}-{pre.fn.node.end_lineno}); "
        f"bwd_dq is the launcher's copy of the f32 dq accumulator into dq",
        f"dq is accumulated {'by load-add-store' if ml.dq_rmw else 'with tl.atomic_add'} into an f32 buffer "
        f"(line {ml.dq.line}): the IR's `store dq_acc[...] += dqp`",
    ]
    if ml.p.lse.info[1] == const(0.0) or ml.p.lse.info[1] is None:  # type: ignore[index]
        notes.append(f"line {ml.p.lse.line}: lse (and delta) are read without a row mask from buffers padded past M; "
                     f"the IR loads lse with `other inf`, so rows past M contribute nothing (the source's padded "
                     f"rows have o = dO = 0 and contribute nothing either)")
    notes.append("P and dS are cast to the input dtype before their dots in the source; the IR keeps fp32 tiles")
    return notes


def _spans(g: _Grad, pre: _Delta, masks: list[Expr]) -> list[tuple[str, str, int, int, str]]:
    ml = g.loops[0]
    f = ml.loop.file
    out = [
        ("bwd_delta", "reduce dt = sum(og, 1)", pre.lines[0], pre.lines[1], pre.fn.file or f),
        ("bwd_probs", "probs p = exp(s - lt)", ml.p.line, ml.p.line, f),
        ("bwd_softmax_grad", "softmax_grad ds = p * (dp - dt)", ml.ds.line, ml.ds.line, f),
        ("bwd_dq_accumulate", "store dq_acc[b, h, m_start:+BLOCK_M, :] += dqp", ml.dq.line, ml.dq.line, ml.dq.file),
        ("bwd_dkdv_epilogue", "store dk[b, hk, n_start:+BLOCK_N, :] = dk_acc", min(g.dk.line, g.dv.line),
         max(g.dk.line, g.dv.line), g.dk.file),
        ("bwd_loop_bounds", f"for m_start in range(...) forward:", ml.loop.line, ml.loop.line, ml.loop.file),
    ]
    return out


def _schedule(tunables: list[LiftedTunable], flags: dict[str, bool]) -> tuple[Schedule, str]:
    """The autotune config whose flag values (e.g. SEQUENCE_PARALLEL) match this combination."""
    fits = [t for t in tunables if all(t.params.get(k.lower(), v) == v for k, v in flags.items())]
    if not fits:
        return Schedule(block_m=64, block_n=64, num_warps=4, num_stages=1), "no config found: 64x64 default"
    t = fits[0]
    nw = t.params.get("num_warps", 4)
    return (Schedule(block_m=int(t.params.get("block_m", 64)), block_n=int(t.params.get("block_n", 64)),
                     num_warps=nw if isinstance(nw, int) else 4, num_stages=int(t.params.get("num_stages", 1))),
            f"schedule from {t.condition} (line {t.provenance.line_start})")


def _tunables(mod: TritonModule, fn: JitFn, base: Provenance, family: str) -> list[LiftedTunable]:
    """The kernel's autotune configs, block sizes named by use (the q-row and kv-row tile extents)."""
    keys = _block_keys(mod, fn)
    out = []
    for c in mod.configs:
        if c.function != fn.name:
            continue
        params: dict[str, object] = {keys.get(k, k.lower()): v for k, v in c.params.items()}
        params["direction"] = "backward"
        prov = replace(base, line_start=c.line, line_end=c.line, lifter="triton", lifter_version=BWD_LIFTER_VERSION)
        out.append(LiftedTunable(family, "any", 0, "any", params, f"{fn.name} autotune config", prov))
    return out


def _block_keys(mod: TritonModule, fn: JitFn) -> dict[str, str]:
    fixed, enumerated = _flags(fn, mod)
    try:
        walk = _walk(mod, fn, {**fixed, **{e: False for e in enumerated}})
        g = _recognise(walk)
    except (Refuse, RecursionError, KBError, KeyError, ValueError, TypeError, IndexError, Unknown):
        return {"BLOCK_M": "block_m", "BLOCK_N": "block_n"}
    out = {}
    for lane, key in ((g.p.q_lane, "block_m"), (g.p.kv_lane, "block_n")):
        extent = walk.lanes[lane]
        if extent.op is ExprOp.VAR:
            out[str(extent.value)] = key
    return out


def _checked(rep: BackwardReport, mod: TritonModule, fn: JitFn, built: _Built, flags: dict[str, bool], label: str,
             base: Provenance, family: str, tunables: list[LiftedTunable]):  # noqa: ANN202 - LiftedProgram | None
    from ingest.lift_triton import LiftedProgram
    from ingest.lift_verify import verify_backward
    from kb.ir.features import derive_features
    from kb.ir.validate import validate

    prog = built.program
    try:
        validate(prog)
    except KBError as err:
        rep.skipped.append((f"{fn.name}[{label}]", f"lifted program fails validation: {err}"))
        return None
    ok, note = verify_backward(prog)
    _add_spans(rep, built, base, mod)
    if not ok:
        rep.skipped.append((f"{fn.name}[{label}]", f"interpreter check failed: {note}"))
        return None
    prov = replace(base, line_start=fn.node.lineno, line_end=fn.node.end_lineno or fn.node.lineno, lifter="triton",
                   lifter_version=BWD_LIFTER_VERSION)
    return LiftedProgram(prog.name, family, prog, prov, tuple(tunables), ok, note, derive_features(prog),
                         tuple(flags.items()), tuple(built.notes))


def _add_spans(rep: BackwardReport, built: _Built, base: Provenance, mod: TritonModule) -> None:
    seen = {(s.kind, s.provenance.file, s.provenance.line_start, s.provenance.line_end) for s in rep.snippets}
    for kind, ir, start, end, file in built.spans:
        file = file or base.file
        if (kind, file, start, end) in seen or start <= 0:
            continue
        seen.add((kind, file, start, end))
        prov = replace(base, file=file, line_start=start, line_end=end, lifter="triton", lifter_version=BWD_LIFTER_VERSION)
        feats = {"backward": True} | ({"causal": True} if built.program.mask_mod is not None else {})
        rep.snippets.append(LiftedSnippet(kind, f"{kind.replace('_', ' ')} ({file.rsplit('/', 1)[-1]}:{start})", ir,
                                          _excerpt(mod, base, file, start, end), feats, prov))


def _excerpt(mod: TritonModule, base: Provenance, file: str, start: int, end: int) -> str:
    lines = mod.lines
    if file != base.file:
        p = mod.path.parent / file.rsplit("/", 1)[-1]
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines() if p.exists() else []
    return "\n".join(lines[start - 1:end])
