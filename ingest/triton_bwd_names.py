"""Source names of a Triton backward kernel -> IR names, found by use (`ingest.lift_triton_bwd`).

A `Names` maps source expressions to IR ones: program ids to grid axes (`b`, `h`, `hk`, `n`, `m`),
sizes to dims (`M`, `N`, `D`, `Hq`, `Hkv`), block-size parameters to schedule constants, the
softmax scale to `sm_scale`, loop variables to IR loop variables. It also turns a tile's pointer
offset into an IR index `[b, head, start:+BLOCK, :]`:
- the q-row, kv-row and head-dim lanes come from the recognised math (`Probs`), their extents are
  BLOCK_M, BLOCK_N, HEAD_PAD;
- M, N, D are the scalar parameters that alone bound those lanes (`offs_m < seqlen_q`);
- a fused batch*head program id splits into `pid // X` (b) and `pid % X` (h), X = Hq; whole program ids
  shared by the q and k pointers are the batch (and the head, without GQA); a k-only program id is the KV
  head `hk` when the q head is a loop `range(hk * G, hk * G + G)` over its group (G = Hq // Hkv).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kb.ir.expr import Expr, ExprOp, call, free_vars, load, replace_subexprs, substitute, var
from ingest.triton_exec import stride_indices
from ingest.triton_grad import Probs, Refuse
from kb.ir.algebra import normal_form
from ingest.triton_tiles import TV, LoopNode, TileWalk, lanes_of, strip_tags
from kb.ir.nodes import Full, Span

__all__ = ["Names", "LANE_CONSTS", "source_index", "lane_roles", "head_roles", "sizes", "scale_param", "index",
           "row_start", "positions"]

LANE_CONSTS = {"q": "BLOCK_M", "kv": "BLOCK_N", "d": "HEAD_PAD"}


@dataclass
class Names:
    values: dict[Expr, Expr] = field(default_factory=dict)  # source sub-expression -> IR (`pid1 // nheads` -> b)
    names: dict[str, Expr] = field(default_factory=dict)  # source name -> IR expression
    lanes: dict[str, str] = field(default_factory=dict)  # lane -> "q" | "kv" | "d"
    index: set[str] = field(default_factory=set)  # IR scalars that are index atoms
    src_index: set[str] = field(default_factory=set)  # source index atoms: lanes, block sizes, loop variables
    kv_head: str = "h"  # what the source indexes k, v, dk, dv by: "hk" with GQA, else the q head (`let hk = h`)
    starts: dict[str, Expr] = field(default_factory=dict)  # "m_start" / "n_start" -> the value their `let` binds
    aux: dict[str, tuple[str, ...]] = field(default_factory=dict)  # aux tables variant functions read -> dims

    def ir(self, e: Expr) -> Expr:
        return normal_form(substitute(replace_subexprs(normal_form(e), self.values), self.names))


def _loop_vars(items: list) -> set[str]:
    return {v for it in items if isinstance(it, LoopNode) for v in {it.var} | _loop_vars(it.body)}


def source_index(walk: TileWalk) -> set[str]:
    """Index atoms of source offsets: lanes (tagged or not), their extents (block sizes), loop variables."""
    extents = {str(e.value) for e in walk.lanes.values() if e.op is ExprOp.VAR}
    return {f"{lane}@{i}" for lane in walk.lanes for i in (0, 1)} | set(walk.lanes) | extents | _loop_vars(walk.body)


def lane_roles(names: Names, walk: TileWalk, p: Probs) -> None:
    for lane, kind in ((p.q_lane, "q"), (p.kv_lane, "kv"), (p.d_lane, "d")):
        names.lanes[lane] = kind
        extent = walk.lanes[lane]
        if extent.op is ExprOp.VAR:
            names.names[str(extent.value)] = var(LANE_CONSTS[kind])
        elif kind != "d":
            raise Refuse(f"the {kind} tile extent {extent} is not a block-size parameter (a loop over tiles of a "
                         f"fraction of a block, such as masked diagonal blocks, does not fit the IR's one "
                         f"{LANE_CONSTS[kind]})")


def _heads(names: Names, t: TV) -> list[Expr]:
    """The source index terms of a tile's offset that are not rows or the head dim (batch, head)."""
    off = normal_form(t.info[0].offset)  # type: ignore[index]
    return [idx for _, idx in stride_indices(off, names.src_index) if not lanes_of(strip_tags(idx))
            and idx.op is not ExprOp.CONST]


def _fused(names: Names, terms: list[Expr]) -> None:
    """`pid // X` is the batch and `pid % X` the head of a fused batch*head program id; X is Hq."""
    for idx in terms:
        if idx.op in (ExprOp.FLOORDIV, ExprOp.MOD) and idx.args[0].op is ExprOp.VAR \
                and str(idx.args[0].value).startswith("pid") and idx.args[1].op is ExprOp.VAR:
            pid, count = var(str(idx.args[0].value)), idx.args[1]
            names.values[pid // count] = var("b")
            names.values[pid % count] = var("h")
            names.names[str(pid.value)] = var("b") * var("Hq") + var("h")
            names.names[str(count.value)] = var("Hq")


def head_roles(names: Names, walk: TileWalk, q: TV, k: TV, strides: dict[str, str] | None = None) -> LoopNode | None:
    """Batch and head roles from the q and k pointers; returns the loop over a GQA group's q heads, if any."""
    qs, ks = _heads(names, q), _heads(names, k)
    _fused(names, qs + ks)
    qs = [x for x in qs if names.ir(x) not in (var("b"), var("h"))]
    ks = [x for x in ks if names.ir(x) not in (var("b"), var("h"))]
    common = [x for x in qs if x in ks]
    q_only, k_only = [x for x in qs if x not in ks], [x for x in ks if x not in qs]
    if not q_only and not k_only:
        _batch_head(names, common, _stride_names(names, q))
        return None
    if len(q_only) == 1 and len(k_only) == 1 and len(common) <= 1:
        loop = _group_loop(names, walk, q_only[0], k_only[0])
        if common:
            _whole(names, common[0], "b")
        return loop
    raise Refuse(f"q heads {[str(x) for x in q_only]} and k heads {[str(x) for x in k_only]}: a head mapping the "
                 f"lifter does not read")


def _stride_names(names: Names, t: TV) -> dict[Expr, str]:
    off = normal_form(t.info[0].offset)  # type: ignore[index]
    return {idx: stride for stride, idx in stride_indices(off, names.src_index)}


def _whole(names: Names, idx: Expr, role: str) -> None:
    if idx.op is not ExprOp.VAR or not str(idx.value).startswith("pid"):
        raise Refuse(f"the {role} index {idx} is not a program id")
    names.names[str(idx.value)] = var(role)


def _batch_head(names: Names, common: list[Expr], strides: dict[Expr, str]) -> None:
    """Whole program ids shared by q and k: batch and head; a stride named like `*b`/`*z` is the batch hint."""
    free = [r for r in ("b", "h") if var(r) not in names.values.values()]
    if len(common) != len(free):
        raise Refuse(f"batch/head indices {[str(x) for x in common]} do not give {free}")
    ordered = sorted(common, key=lambda x: (strides.get(x, "")[-1:] not in ("b", "z"), str(x)))
    for idx, role in zip(ordered, free):
        _whole(names, idx, role)


def _group_loop(names: Names, walk: TileWalk, q_head: Expr, k_head: Expr) -> LoopNode:
    """q head = a loop `range(hk * G, hk * G + G)` over the KV head's group: G = X // Y makes X Hq and Y Hkv."""
    loops = [lp for lp in _all_loops(walk.body) if q_head == var(lp.var)]
    if len(loops) != 1 or k_head.op is not ExprOp.VAR:
        raise Refuse(f"the q head {q_head} is not a loop over the q heads of KV head {k_head}")
    loop = loops[0]
    group = normal_form(loop.hi - loop.lo)
    if normal_form(loop.lo) != normal_form(k_head * group) or normal_form(loop.step).value != 1:
        raise Refuse(f"line {loop.line}: the q-head loop range({loop.lo}, {loop.hi}) is not hk * G .. hk * G + G")
    if group.op is ExprOp.FLOORDIV and all(a.op is ExprOp.VAR for a in group.args):
        names.names[str(group.args[0].value)] = var("Hq")
        names.names[str(group.args[1].value)] = var("Hkv")
    elif group.op is ExprOp.VAR:
        names.names[str(group.value)] = var("Hq") // var("Hkv")
    else:
        raise Refuse(f"line {loop.line}: the group size {group} is not X // Y or one parameter")
    _whole(names, k_head, "hk")
    names.names[loop.var] = var("h")
    names.kv_head = "hk"
    return loop


def _all_loops(items: list) -> list[LoopNode]:
    out = []
    for it in items:
        if isinstance(it, LoopNode):
            out += [it] + _all_loops(it.body)
    return out


def sizes(names: Names, walk: TileWalk) -> None:
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


def scale_param(names: Names, walk: TileWalk, p: Probs) -> None:
    s = normal_form(p.scale)
    if s.op is not ExprOp.VAR or str(s.value) not in walk.scalars:
        raise Refuse(f"the scores are scaled by {p.scale}, not by one scalar parameter")
    names.names[str(s.value)] = var("sm_scale")


def index(names: Names, off: Expr, tensor: str, head: str, rows: str, d: bool = True) -> tuple:
    """The IR index of a tile at source offset `off`: [b, head, rows:+BLOCK(, :)]."""
    ir = names.ir(off)
    found: dict[str, object] = {}
    atoms = names.index | {v for v in free_vars(ir) if v.startswith("_l_")}
    for stride, idx in stride_indices(ir, atoms):
        plain = strip_tags(idx)
        kinds = {names.lanes.get(lane) for lane in lanes_of(plain)}
        if kinds == {"d"} and plain.op is ExprOp.VAR:
            found["d"] = Full()
        elif len(kinds) == 1 and kinds <= {"q", "kv"}:
            (kind,) = kinds
            assert kind is not None  # kinds <= {"q", "kv"}
            start = normal_form(plain - var(next(iter(lanes_of(plain)))))
            if lanes_of(start):
                raise Refuse(f"{tensor}: row index {plain} is not a start plus one lane")
            at = "m_start" if kind == "q" else "n_start"
            start = var(at) if names.starts.get(at) == start else start
            found["rows" if kind == rows else "other rows"] = Span(start, LANE_CONSTS[kind])
        elif idx == var("b"):
            found["b"] = idx
        elif free_vars(idx) and free_vars(idx) <= {"h", "hk"}:
            found["head"] = idx
        elif idx.op is not ExprOp.CONST:
            raise Refuse(f"{tensor}: offset term {idx} (stride {stride or 1}) is not the batch, head, rows or head dim")
    want = ["b", "head", "rows"] + (["d"] if d else [])
    missing = [w for w in want if w not in found] + (["(other rows)"] if "other rows" in found else [])
    if missing:
        raise Refuse(f"{tensor}: offset {ir} has no {', '.join(missing)} term")
    expected = var(names.kv_head if head == "hk" else head)
    if found["head"] != expected:
        raise Refuse(f"{tensor}: head index {found['head']}, expected {expected}")
    found["head"] = var(head)
    return tuple(found[w] for w in want)


def row_start(names: Names, t: TV) -> tuple[Expr, str]:
    """(start, lane) of the row term of a tile's source offset (its q-row or kv-row lane)."""
    off = normal_form(t.info[0].offset)  # type: ignore[index]
    for _, idx in stride_indices(off, names.src_index):
        plain = strip_tags(idx)
        rows = [lane for lane in lanes_of(plain) if names.lanes.get(lane) in ("q", "kv")]
        if rows:
            return normal_form(plain - var(rows[0])), rows[0]
    raise Refuse(f"line {t.line}: the tile has no row term")


def positions(names: Names, p: Probs, e: Expr) -> Expr:
    """`e` (source, over lanes) in absolute IR positions: lane = q_idx - (q tile start), kv_idx - (k tile start);
    scalar table loads become aux loads (`alibi_slopes[b, h]`), `abs` arguments get one sign."""
    at = {}
    for t, pos in ((p.q, "q_idx"), (p.k, "kv_idx")):
        start, lane = row_start(names, t)
        at[lane] = var(pos) - start
    return _canonical(names, names.ir(normal_form(substitute(strip_tags(e), at))))


def _canonical(names: Names, e: Expr) -> Expr:
    args = tuple(_canonical(names, a) for a in e.args)
    if e.op is ExprOp.LOAD:
        return _aux_load(names, e)
    if e.op is ExprOp.ABS:
        pos, neg = normal_form(args[0]), normal_form(-args[0])
        return call("abs", min(pos, neg, key=str))
    return Expr(e.op, args, e.value) if args else e


def _aux_load(names: Names, e: Expr) -> Expr:
    """`T[b * s_b + h * s_h]` (a flat scalar load) -> `t[b, h]`, recording the aux param t: [B, Hq]."""
    if len(e.args) != 1:
        return e
    idx = {str(i) for _, i in stride_indices(normal_form(e.args[0]), {"b", "h"}) if i.op is not ExprOp.CONST}
    if not idx or not idx <= {"b", "h"}:
        raise Refuse(f"table load {e} is not indexed by the batch and head")
    dims = [d for d in ("b", "h") if d in idx]
    name = str(e.value).lower()
    names.aux[name] = tuple({"b": "B", "h": "Hq"}[d] for d in dims)
    return load(name, *(var(d) for d in dims))

