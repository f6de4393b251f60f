"""Lift Triton attention backward kernels into complete backward IR programs (checked against autograd).

`lift_backward(mod, base, family)` sorts the top-level `@triton.jit` kernels of a parsed file by dataflow
(`ingest.triton_bwd_kernels`): delta kernels, KV-outer kernels (dK, dV; dQ by atomics or load-add-store)
and dQ passes. Each flag combination that lifts becomes one program in the canonical shape of the
backward IR (docs/ir.md, "Backward programs"):
- `bwd_preprocess`: delta = rowsum(o * dO), from the file's delta kernel (linked by its launch when the
  launcher is in the file);
- `bwd_dkdv`: one program per KV block (a program id) or per (b, h) looping over KV blocks, the q heads of a
  GQA group in a loop, q blocks in the source's own loops and bounds, the source's masks;
- `bwd_dq`: the launcher's copy of the f32 dq accumulator (`store dq_acc[...] += ...` in bwd_dkdv), or a
  dQ pass kernel of the file with the same masks (Q-outer, recomputing P and dS).
Sizes, grid roles, the softmax scale, lse, delta and dO are read by use (`ingest.triton_bwd_names`).
Every program is validated and run by the interpreter against torch autograd; what does not lift is
reported with its reason.
"""

from __future__ import annotations

import ast
import copy
import itertools
import logging
from dataclasses import dataclass, field, replace

from kb.errors import KBError
from kb.ir.expr import Expr, ExprOp, const, free_vars, substitute, var
from kb.ir.nodes import (
    Dot, Dtype, Elementwise, For, Full, GridAxis, Init, Kernel, Let, Load, Mask, Param, Probs as ProbsStmt,
    Program, Reduce, Role, Schedule, ScoreMod, ScoreModGrad, SoftmaxGrad as SoftmaxGradStmt, Span, Store,
    TileAt, VariantFn, MASK_MOD_PARAMS, SCORE_MOD_PARAMS,
)
from kb.ir.features import derive_features
from kb.ir.text import print_stmt_header
from kb.ir.validate import validate
from ingest.lift_verify import verify_backward
from ingest.model import LiftedProgram, LiftedSnippet, LiftedTunable, Provenance, as_int
from ingest.triton_bwd_kernels import (
    Delta, KVOuter, ancestors, early_exits, kind_of, recognise_delta, recognise_dq_pass, recognise_kv_outer,
)
from ingest.triton_bwd_names import (
    Names, head_roles, index, lane_roles, positions, row_start, scale_param, sizes, source_index,
)
from ingest.triton_flags import flag_values, merge_skips
from ingest.triton_grad import Probs, Refuse
from ingest.triton_source import JitFn, TritonModule, Unknown, specialize
from kb.ir.algebra import all_of, conjuncts, normal_compare, normal_form
from ingest.triton_tiles import TV, LoopNode, TileWalk, walk_tiles

__all__ = ["BackwardReport", "lift_backward", "BWD_LIFTER_VERSION"]

log = logging.getLogger(__name__)
BWD_LIFTER_VERSION = "triton-bwd-1"
_BWD_POLICY = {"DEBUG": False}  # debug prints and dumps off (a prefix of the constexpr's name)
_AT = TileAt(var("b"), var("h"), var("m_start"), var("n_start"))
_HEAD_LOOP = (Expr(ExprOp.MUL, (var("hk"), Expr(ExprOp.FLOORDIV, (var("Hq"), var("Hkv"))))),
              Expr(ExprOp.MUL, (Expr(ExprOp.ADD, (var("hk"), const(1))), Expr(ExprOp.FLOORDIV, (var("Hq"), var("Hkv"))))))


@dataclass
class BackwardReport:
    programs: list[LiftedProgram] = field(default_factory=list)
    snippets: list[LiftedSnippet] = field(default_factory=list)
    tunables: list[LiftedTunable] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    handled: set[str] = field(default_factory=set)  # kernels the forward lifter must leave alone
    coverage: list[tuple[str, str]] = field(default_factory=list)  # (kernel, "lifted: ..." or why not)


@dataclass
class _Part:
    """One source kernel (one flag combination) turned into an IR kernel, with what the program needs from it."""

    fn: JitFn
    flags: dict[str, bool]
    kernel: Kernel
    masks: list[Expr]  # mask_mod terms
    score: list[Expr]  # additive score terms (score_mod = score + ...)
    gqa: bool
    accumulates_dq: bool  # bwd_dkdv adds into dq_acc (then bwd_dq converts)
    notes: list[str]
    spans: list[tuple[str, str, int, int, str]]  # (snippet kind, ir text, start, end, file)
    p: Probs
    delta_base: str  # the pointer parameters read as delta and dO (to link the delta kernel by its launch)
    dout_base: str
    extents: dict[str, str]  # block-size parameter -> tunable key ("block_m", "block_n")
    aux: dict[str, tuple[str, ...]]  # aux tables the score terms read -> their dims


def _extents(walk: TileWalk, p: Probs) -> dict[str, str]:
    return {str(walk.lanes[lane].value): key for lane, key in ((p.q_lane, "block_m"), (p.kv_lane, "block_n"))
            if walk.lanes[lane].op is ExprOp.VAR}


# ================================================================ IR pieces


def _scores(mask: str | None, scored: bool) -> list:
    """s = sm_scale * q kᵀ, score_mod, the mask, P = exp(s - lse)."""
    out: list = [Dot("s", "qt", "kt", trans_b=True), Elementwise("s", Expr(ExprOp.MUL, (var("s"), var("sm_scale"))))]
    s = "sm" if scored else "s"
    if scored:
        out += [Elementwise("sm", var("s")), ScoreMod("sm", _AT)]
    if mask is not None:
        out.append(Mask(s, _AT, use_mask_mod=mask == "mask_mod"))
    return out + [ProbsStmt("p", s, "lt")]


def _grad(scored: bool) -> list:
    """dP = dO vᵀ, dS = P (dP - delta), score_mod's derivative, the scale."""
    out: list = [Dot("dp", "gt", "vt", trans_b=True), SoftmaxGradStmt("ds", "p", "dp", "dt")]
    if scored:
        out.append(ScoreModGrad("ds", "s", _AT))
    return out + [Elementwise("ds", Expr(ExprOp.MUL, (var("ds"), var("sm_scale"))))]


def _row_loads(names: Names, p: Probs, dout: TV, delta: TV) -> list:
    return [
        Load("qt", "q", index(names, p.q.info[0].offset, "q", "h", "q")),  # type: ignore[index]
        Load("gt", "dout", index(names, dout.info[0].offset, "dout", "h", "q")),  # type: ignore[index]
        Load("lt", "lse", index(names, p.lse.info[0].offset, "lse", "h", "q", d=False), other=float("inf")),  # type: ignore[index]
        Load("dt", "delta", index(names, delta.info[0].offset, "delta", "h", "q", d=False)),  # type: ignore[index]
    ]


def _kv_loads(names: Names, p: Probs, v: TV) -> list:
    rows = index(names, p.k.info[0].offset, "k", "hk", "kv")  # type: ignore[index]
    if index(names, v.info[0].offset, "v", "hk", "kv") != rows:  # type: ignore[index]
        raise Refuse("v rows differ from k's")
    return [Load("kt", "k", rows), Load("vt", "v", rows)]


def _enter(names: Names, loop: LoopNode, p: Probs, kind: str) -> tuple[str, list, tuple[Expr, Expr] | None]:
    """Name the source loop over q blocks (kind "q") or KV blocks ("kv"). Its variable is the tile start
    (`m_start` / `n_start`); a counter whose tile start is `base + i * BLOCK` becomes that start, stepping
    by the block (`range(base + lo * BLOCK, base + hi * BLOCK, BLOCK)`, the same blocks); any other counter
    stays (`mi` / `ni`) with `let m_start = ...` first in the body. Returns (variable, lets, new bounds)."""
    start_name, block = ("m_start", "BLOCK_M") if kind == "q" else ("n_start", "BLOCK_N")
    src, _ = row_start(names, p.q if kind == "q" else p.k)
    counter = start_name[0] + "i"
    names.index |= {start_name, counter}
    names.starts.pop(start_name, None)
    if src == var(loop.var):
        names.names[loop.var] = var(start_name)
        return start_name, [], None
    names.names[loop.var] = var(counter)
    start = names.ir(src)
    names.starts[start_name] = start  # tiles at this start are indexed by `m_start` / `n_start`
    base = normal_form(substitute(start, {counter: const(0)}))
    if names.ir(loop.step) == const(1) and normal_form(Expr(ExprOp.SUB, (start, base))) == \
            normal_form(Expr(ExprOp.MUL, (var(counter), var(block)))):
        at = lambda i: normal_form(substitute(start, {counter: names.ir(i)}))  # noqa: E731
        return start_name, [], (at(loop.lo), at(loop.hi))
    return counter, [Let(start_name, start)], None


def _loop(names: Names, loop: LoopNode, kind: str, entered: tuple, body: list) -> For:
    loop_var, lets, bounds = entered
    block = "BLOCK_M" if kind == "q" else "BLOCK_N"
    if bounds is not None:
        return For(loop_var, bounds[0], bounds[1], block, "forward", tuple(lets + body))
    step = names.ir(loop.step)
    step_dim = block if step == var(block) else step.value if step.op is ExprOp.CONST else None
    if not isinstance(step_dim, (str, int)) or isinstance(step_dim, bool):
        raise Refuse(f"line {loop.line}: the loop over {kind} blocks steps by {step}")
    return For(loop_var, names.ir(loop.lo), names.ir(loop.hi), step_dim, "forward", tuple(lets + body))


def _mask_kind(names: Names, p: Probs) -> tuple[str | None, list[Expr]]:
    """("mask_mod" | "bounds" | None, mask_mod terms) for the masks on this loop's scores."""
    terms: list[Expr] = []
    bounded = False
    for cond in p.masks:
        for c in conjuncts(positions(names, p, cond)):
            c = normal_compare(c.op, c.args[0], c.args[1]) if c.op in (ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE) else c
            if c == normal_compare(ExprOp.LT, var("kv_idx"), var("N")):
                bounded = True
            elif "q_idx" in (fv := _vars(c)) and fv <= {"q_idx", "kv_idx", "b", "h", "M", "N", "D", "Hq", "Hkv"}:
                terms += [c] if c not in terms else []
            else:
                raise Refuse(f"mask {c} on the scores is neither a mask_mod term (over q_idx, kv_idx, dims) nor "
                             f"the kv_idx < N bound")
    return ("mask_mod" if terms else "bounds" if bounded else None), terms


def _vars(e: Expr) -> set[str]:
    return set(free_vars(e))


def _score_terms(names: Names, p: Probs) -> list[Expr]:
    out = []
    for t in p.terms:
        ir = positions(names, p, t)
        bad = _vars(ir) - {"q_idx", "kv_idx", "b", "h", "M", "N", "Hq", "Hkv"}
        if bad:
            raise Refuse(f"score term {ir} uses names the IR cannot bind: {sorted(bad)}")
        out.append(ir)
    return out


def _same_variants(parts: list[tuple[str | None, list[Expr], list[Expr]]]) -> tuple[list[Expr], list[Expr]]:
    """One mask_mod and score_mod for every loop: masking loops share their terms, unmasked loops are unmasked."""
    masks = [terms for kind, terms, _ in parts if kind == "mask_mod"]
    scores = [s for _, _, s in parts]
    if any(m != masks[0] for m in masks) or any(s != scores[0] for s in scores):
        raise Refuse("the loops apply different masks or score terms")
    return (masks[0] if masks else []), scores[0]


# ================================================================ kernels


def _names(walk: TileWalk, p: Probs, q: TV, k: TV) -> tuple[Names, LoopNode | None]:
    names = Names(src_index=source_index(walk))
    lane_roles(names, walk, p)
    group = head_roles(names, walk, q, k)
    sizes(names, walk)
    scale_param(names, walk, p)
    names.index |= {"b", "h", "hk", "n", "m", "n_start", "m_start"}
    return names, group


def _kv_axis(names: Names, g: KVOuter) -> tuple[tuple[GridAxis, ...], LoopNode | None]:
    """The KV block: a program id (one program per KV block) or the loop around the dK/dV stores."""
    start, _ = row_start(names, g.p.k)
    pids = sorted(v for v in _vars(start) if v.startswith("pid") and v not in names.names)
    serial = [lp for lp in g.outer if lp.var in _vars(start)]
    n_start = normal_form(Expr(ExprOp.MUL, (var("n"), var("BLOCK_N"))))
    if len(pids) == 1 and not serial:
        names.names[pids[0]] = var("n")
        axis: tuple[GridAxis, ...] = (GridAxis("n", Expr(ExprOp.CDIV, (var("N"), var("BLOCK_N")))),)
        loop = None
    elif len(serial) == 1 and not pids and len(g.outer) == 1:
        names.names[serial[0].var] = var("n")
        axis, loop = (), serial[0]
        if (names.ir(loop.lo), names.ir(loop.step), names.ir(loop.hi)) != \
                (const(0), const(1), Expr(ExprOp.CDIV, (var("N"), var("BLOCK_N")))):
            raise Refuse(f"line {loop.line}: the loop over KV blocks is not range(0, cdiv(N, BLOCK_N))")
    else:
        raise Refuse(f"the KV block start {start} is neither one program id nor one loop variable")
    if names.ir(start) != n_start:
        raise Refuse(f"the KV block start {names.ir(start)} is not n * BLOCK_N")
    return axis, loop


def _kv_outer(walk: TileWalk, fn: JitFn, flags: dict[str, bool]) -> _Part:
    g = recognise_kv_outer(walk)
    names, group = _names(walk, g.p, g.p.q, g.p.k)
    axis, serial = _kv_axis(names, g)
    names.starts["n_start"] = normal_form(Expr(ExprOp.MUL, (var("n"), var("BLOCK_N"))))
    notes: list[str] = []
    variants, loops = [], []
    for ml in g.loops:
        extra = ancestors(walk, ml.loop)[len(g.outer):]
        if list(extra) != ([group] if group is not None else []):
            raise Refuse(f"line {ml.loop.line}: the q-block loop sits in loops {[lp.line for lp in extra]} besides "
                         f"the GQA group's")
        entered = _enter(names, ml.loop, ml.p, "q")
        body = list(entered[1])
        kind, terms = _mask_kind(names, ml.p)
        variants.append((kind, terms, _score_terms(names, ml.p)))
        body += _row_loads(names, ml.p, ml.ds.dout, ml.ds.delta) + _scores(kind, bool(ml.p.terms)) + [
            Dot("dvp", "p", "gt", trans_b=False, trans_a=True),
            Elementwise("dv_acc", Expr(ExprOp.ADD, (var("dv_acc"), var("dvp")))),
        ] + _grad(bool(ml.p.terms)) + [
            Dot("dkp", "ds", "qt", trans_b=False, trans_a=True),
            Elementwise("dk_acc", Expr(ExprOp.ADD, (var("dk_acc"), var("dkp")))),
        ]
        if ml.dq is not None:
            body += [Dot("dqp", "ds", "kt", trans_b=False),
                     Store("dq_acc", index(names, ml.dq.ptr.offset, "dq_acc", "h", "q"), "dqp", accumulate=True)]
        loops.append(_loop(names, ml.loop, "q", entered, body[len(entered[1]):]))
    masks, score = _same_variants(variants)
    rows = (var("b"), var("hk"), Span(var("n_start"), "BLOCK_N"), Full())
    for eff, name in ((g.dk, "dk"), (g.dv, "dv")):
        if index(names, eff.ptr.offset, name, "hk", "kv") != index(names, g.p.k.info[0].offset, "k", "hk", "kv"):  # type: ignore[index]
            raise Refuse(f"line {eff.line}: {name} is stored at other rows than k is loaded from")
    scope: list = [Let("n_start", Expr(ExprOp.MUL, (var("n"), var("BLOCK_N"))))] + _kv_loads(names, g.p, g.loops[0].ds.v)
    scope += [Init("dk_acc", ("BLOCK_N", "HEAD_PAD"), 0.0, Dtype.F32), Init("dv_acc", ("BLOCK_N", "HEAD_PAD"), 0.0, Dtype.F32)]
    scope += [For("h", *_HEAD_LOOP, 1, "forward", tuple(loops))] if group is not None else loops
    scope += [Store("dk", rows, "dk_acc"), Store("dv", rows, "dv_acc")]
    head = GridAxis("hk", var("Hkv")) if group is not None else GridAxis("h", var("Hq"))
    body = [] if group is not None else [Let("hk", var("h"))]
    if serial is None:
        body += scope
    else:
        body.append(For("n", const(0), Expr(ExprOp.CDIV, (var("N"), var("BLOCK_N"))), 1, "forward", tuple(scope)))
        notes.append(f"line {serial.line}: one program per (b, h) loops over the KV blocks and adds dS·K into dq by "
                     f"load-add-store (no atomics): the IR's `store dq_acc[...] += dqp` in that loop")
    notes += _early_exit_notes(walk, g)
    notes += _kv_outer_notes(g, group)
    kernel = Kernel("bwd_dkdv", (GridAxis("b", var("B")), head) + axis, tuple(body))
    ds = g.loops[0].ds
    if ds.delta.info[0].base == g.p.lse.info[0].base:  # type: ignore[index]
        raise Refuse(f"line {ds.line}: dS subtracts the log-sum-exp ({g.p.lse.info[0].base}), not delta")  # type: ignore[index]
    return _Part(fn, flags, kernel, masks, score, group is not None, g.loops[0].dq is not None, notes,
                 _kv_outer_spans(g, loops[0]), g.p, ds.delta.info[0].base, ds.dout.info[0].base, _extents(walk, g.p),  # type: ignore[index]
                 dict(names.aux))


def _kv_outer_notes(g: KVOuter, group: LoopNode | None) -> list[str]:
    ml = g.loops[0]
    out = []
    if ml.dq is not None:
        out.append(f"dq is accumulated {'by load-add-store' if ml.dq_rmw else 'with tl.atomic_add'} into an f32 "
                   f"buffer (line {ml.dq.line}): the IR's `store dq_acc[...] += dqp`; bwd_dq is the launcher's copy of "
                   f"that buffer into dq")
    if group is not None:
        out.append(f"line {group.line}: dK and dV of a KV head sum over the q heads of its group (GQA loop)")
    out.append(f"line {ml.p.lse.line}: the IR loads lse with `other inf` (rows past M give p = 0); the source's rows past "
               f"M read zero q and dO tiles and contribute nothing either")
    out.append("P and dS are cast to the input dtype before their dots in the source; the IR keeps fp32 tiles")
    return out


def _early_exit_notes(walk: TileWalk, g: KVOuter) -> list[str]:
    """An early exit must store what the main path stores when its q-block loops are empty: zero dK, dV."""
    out = []
    for ex in early_exits(walk.body):
        stored = {e.ptr.base for e in ex.effects}
        if any(not isinstance(e.value, TV) or e.value.op != "zeros" for e in ex.effects) \
                or not stored <= {g.dk.ptr.base, g.dv.ptr.base}:
            raise Refuse(f"lines {ex.line}-{ex.end_line}: an early exit stores something other than zero dK/dV")
        out.append(f"lines {ex.line}-{ex.end_line}: early exit storing zero dK/dV when the KV block has no q rows "
                   f"to visit; the IR runs the empty q-block loop and stores the zero accumulators")
    return out


def _kv_outer_spans(g: KVOuter, loop: For) -> list[tuple[str, str, int, int, str]]:
    ml = g.loops[0]
    out = [("bwd_probs", "probs p = exp(s - lt)", ml.p.line, ml.p.line, ml.loop.file),
           ("bwd_softmax_grad", "softmax_grad ds = p * (dp - dt)", ml.ds.line, ml.ds.line, ml.loop.file),
           ("bwd_dkdv_epilogue", "store dk[b, hk, n_start:+BLOCK_N, :] = dk_acc", min(g.dk.line, g.dv.line),
            max(g.dk.line, g.dv.line), g.dk.file),
           ("bwd_loop_bounds", print_stmt_header(loop), ml.loop.line,
            ml.loop.line, ml.loop.file)]
    if ml.dq is not None:
        out.append(("bwd_dq_accumulate", "store dq_acc[b, h, m_start:+BLOCK_M, :] += dqp", ml.dq.line, ml.dq.line,
                    ml.dq.file))
    return out


def _dq_pass(walk: TileWalk, fn: JitFn, flags: dict[str, bool]) -> _Part:
    d = recognise_dq_pass(walk)
    names, group = _names(walk, d.p, d.p.q, d.p.k)
    start, _ = row_start(names, d.p.q)
    pids = sorted(v for v in _vars(start) if v.startswith("pid") and v not in names.names)
    if len(pids) != 1:
        raise Refuse(f"the q block start {start} of the dQ pass is not one program id")
    names.names[pids[0]] = var("m")
    names.starts["m_start"] = normal_form(Expr(ExprOp.MUL, (var("m"), var("BLOCK_M"))))
    if names.ir(start) != names.starts["m_start"]:
        raise Refuse(f"the q block start {names.ir(start)} is not m * BLOCK_M")
    variants, loops = [], []
    for kl in d.loops:
        extra = ancestors(walk, kl.loop)[len(d.outer):]
        if list(extra):
            raise Refuse(f"line {kl.loop.line}: the KV-block loop sits in loops {[lp.line for lp in extra]}")
        entered = _enter(names, kl.loop, kl.p, "kv")
        body = list(entered[1])
        kind, terms = _mask_kind(names, kl.p)
        variants.append((kind, terms, _score_terms(names, kl.p)))
        body += _kv_loads(names, kl.p, kl.ds.v) + _scores(kind, bool(kl.p.terms)) + _grad(bool(kl.p.terms)) + [
            Dot("dqp", "ds", "kt", trans_b=False), Elementwise("dqa", Expr(ExprOp.ADD, (var("dqa"), var("dqp"))))]
        loops.append(_loop(names, kl.loop, "kv", entered, body[len(entered[1]):]))
    masks, score = _same_variants(variants)
    if d.outer != ((group,) if group is not None else ()):
        raise Refuse(f"line {d.store.line}: dQ is stored inside loops {[lp.line for lp in d.outer]}")
    rows = index(names, d.store.ptr.offset, "dq", "h", "q")
    per_head: list = _row_loads(names, d.p, d.loops[0].ds.dout, d.loops[0].ds.delta)
    per_head += [Init("dqa", ("BLOCK_M", "HEAD_PAD"), 0.0, Dtype.F32)] + loops + [Store("dq", rows, "dqa")]
    body = [Let("m_start", Expr(ExprOp.MUL, (var("m"), var("BLOCK_M"))))]
    body += [Let("hk", var("h"))] + per_head if group is None else [For("h", *_HEAD_LOOP, 1, "forward", tuple(per_head))]
    head = GridAxis("hk", var("Hkv")) if group is not None else GridAxis("h", var("Hq"))
    kernel = Kernel("bwd_dq", (GridAxis("b", var("B")), head, GridAxis("m", Expr(ExprOp.CDIV, (var("M"), var("BLOCK_M"))))),
                    tuple(body))
    kl = d.loops[0]
    spans = [("bwd_dq_accumulate", "dot dqp = ds @ kt", d.store.line, d.store.line, d.store.file),
             ("bwd_loop_bounds", print_stmt_header(loops[0]), kl.loop.line,
              kl.loop.line, kl.loop.file)]
    notes = [f"dq by a separate pass ({fn.name}, lines {fn.node.lineno}-{fn.node.end_lineno}): Q-outer, recomputing P "
             f"and dS over the KV blocks"]
    ds = d.loops[0].ds
    if ds.delta.info[0].base == d.p.lse.info[0].base:  # type: ignore[index]
        raise Refuse(f"line {ds.line}: dS subtracts the log-sum-exp ({d.p.lse.info[0].base}), not delta")  # type: ignore[index]
    return _Part(fn, flags, kernel, masks, score, group is not None, False, notes, spans, d.p,
                 ds.delta.info[0].base, ds.dout.info[0].base, _extents(walk, d.p), dict(names.aux))  # type: ignore[index]


def _delta(walk: TileWalk, fn: JitFn) -> tuple[Kernel, Delta, list]:
    d = recognise_delta(walk)
    a = d.o
    names = Names(src_index=source_index(walk))
    lane_q = d.store.value.lanes[0]  # type: ignore[union-attr]
    lane_d = next(lane for lane in a.lanes if lane != lane_q)
    names.lanes = {lane_q: "q", lane_d: "d"}
    for lane, const_name in ((lane_q, "BLOCK_M"), (lane_d, "HEAD_PAD")):
        if walk.lanes[lane].op is ExprOp.VAR:
            names.names[str(walk.lanes[lane].value)] = var(const_name)
    head_roles(names, walk, a, a)
    start = row_start(names, a)[0]
    pids = sorted(v for v in _vars(start) if v.startswith("pid") and v not in names.names)
    if len(pids) != 1:
        raise Refuse(f"the row block of the delta kernel is not one program id ({start})")
    names.names[pids[0]] = var("m")
    sizes(names, walk)
    names.index |= {"m", "b", "h"}
    idx = index(names, a.info[0].offset, "o", "h", "q")  # type: ignore[index]
    if index(names, d.g.info[0].offset, "dout", "h", "q") != idx:  # type: ignore[index]
        raise Refuse("o and dO tiles are read at different offsets")
    if idx[2] != Span(normal_form(Expr(ExprOp.MUL, (var("m"), var("BLOCK_M")))), "BLOCK_M"):
        raise Refuse(f"the delta kernel's rows {idx[2]} are not m * BLOCK_M + lane")
    if index(names, d.store.ptr.offset, "delta", "h", "q", d=False) != idx[:3]:
        raise Refuse("delta is stored at other rows than o is read")
    at = (var("b"), var("h"), Span(var("m_start"), "BLOCK_M"))
    kernel = Kernel("bwd_preprocess", (GridAxis("b", var("B")), GridAxis("h", var("Hq")),
                                       GridAxis("m", Expr(ExprOp.CDIV, (var("M"), var("BLOCK_M"))))), (
        Let("m_start", Expr(ExprOp.MUL, (var("m"), var("BLOCK_M")))),
        Load("ot", "o", at + (Full(),)), Load("gt", "dout", at + (Full(),)),
        Elementwise("og", Expr(ExprOp.MUL, (var("ot"), var("gt")))), Reduce("dt", "sum", "og", 1),
        Store("delta", at, "dt"),
    ))
    spans = [("bwd_delta", "reduce dt = sum(og, 1)", d.store.line, d.store.line, d.store.file)]
    return kernel, d, spans


def _convert_kernel() -> Kernel:
    at = (var("b"), var("h"), Span(var("m_start"), "BLOCK_M"), Full())
    return Kernel("bwd_dq", (GridAxis("b", var("B")), GridAxis("h", var("Hq")),
                             GridAxis("m", Expr(ExprOp.CDIV, (var("M"), var("BLOCK_M"))))), (
        Let("m_start", Expr(ExprOp.MUL, (var("m"), var("BLOCK_M")))),
        Load("dqt", "dq_acc", at),
        Store("dq", at, "dqt"),
    ))


# ================================================================ programs


_PARAMS = (
    Param("q", ("B", "Hq", "M", "D"), Dtype.F16, Role.IN), Param("k", ("B", "Hkv", "N", "D"), Dtype.F16, Role.IN),
    Param("v", ("B", "Hkv", "N", "D"), Dtype.F16, Role.IN), Param("o", ("B", "Hq", "M", "D"), Dtype.F16, Role.IN),
    Param("dout", ("B", "Hq", "M", "D"), Dtype.F16, Role.IN), Param("lse", ("B", "Hq", "M"), Dtype.F32, Role.IN),
    Param("dq", ("B", "Hq", "M", "D"), Dtype.F16, Role.OUT), Param("dk", ("B", "Hkv", "N", "D"), Dtype.F16, Role.OUT),
    Param("dv", ("B", "Hkv", "N", "D"), Dtype.F16, Role.OUT), Param("delta", ("B", "Hq", "M"), Dtype.F32, Role.SCRATCH),
    Param("dq_acc", ("B", "Hq", "M", "D"), Dtype.F32, Role.SCRATCH), Param("sm_scale", (), Dtype.F32, Role.SCALAR),
)


@dataclass
class _DeltaKernel:
    fn: JitFn
    kernel: Kernel
    delta: Delta
    spans: list


def _program(name: str, pre: _DeltaKernel, dkdv: _Part, dq: _Part | None, schedule: Schedule) -> Program:
    params = _PARAMS if dq is None else tuple(p for p in _PARAMS if p.name != "dq_acc")
    params += tuple(Param(name, dims, Dtype.F32, Role.AUX) for name, dims in sorted(dkdv.aux.items()))
    score = None
    if dkdv.score:
        score = var("score")
        for t in dkdv.score:
            score = Expr(ExprOp.ADD, (score, t))
    return Program(name, params, schedule, (pre.kernel, dkdv.kernel, dq.kernel if dq is not None else _convert_kernel()),
                   score_mod=VariantFn("score_mod", SCORE_MOD_PARAMS, score) if score is not None else None,
                   mask_mod=VariantFn("mask_mod", MASK_MOD_PARAMS, all_of(dkdv.masks)) if dkdv.masks else None)


def _launch_args(mod: TritonModule, kernel: str) -> dict[str, str] | None:
    """Parameter -> the launcher's variable passed to it (positional plain names), from the first launch site."""
    fn = mod.jit[kernel]
    for site in mod.launches:
        if site.kernel == kernel:
            return {a.arg: name for a, name in zip(fn.node.args.args, site.args) if name is not None}
    return None


def _pick_delta(mod: TritonModule, part: _Part, deltas: list[_DeltaKernel], notes: list[str]) -> _DeltaKernel:
    """The delta kernel whose stored buffer (and dO operand) the launcher passes to this kernel's delta (and dO)."""
    if not deltas:
        raise Refuse("no kernel in the file computes delta = rowsum(o * dO)")
    here = _launch_args(mod, part.fn.name)
    for pre in deltas:
        there = _launch_args(mod, pre.fn.name)
        if here is None or there is None:
            continue
        delta_arg, dout_arg = here.get(part.delta_base), here.get(part.dout_base)
        if delta_arg is not None and there.get(pre.delta.store.ptr.base) == delta_arg:
            operands = {there.get(pre.delta.o.info[0].base), there.get(pre.delta.g.info[0].base)}  # type: ignore[index]
            if dout_arg not in operands:
                raise Refuse(f"the launcher passes {dout_arg} as dO, but {pre.fn.name} multiplies {sorted(map(str, operands))}")
            notes.append(f"delta kernel {pre.fn.name} linked by its launch: it stores `{delta_arg}`, which "
                         f"{part.fn.name} reads as delta")
            return pre
    notes.append(f"delta kernel {deltas[0].fn.name} matched by dataflow only (no launches link it to {part.fn.name})")
    return deltas[0]


# ================================================================ driver


def _flags(fn: JitFn, mod: TritonModule) -> tuple[dict[str, object], list[str]]:
    fixed, enumerated = flag_values(fn, mod)
    for n in fn.constexprs:
        if any(n.startswith(p) for p in _BWD_POLICY):
            fixed[n] = next(v for p, v in _BWD_POLICY.items() if n.startswith(p))
    return fixed, [e for e in enumerated if e not in fixed]


def _walk(mod: TritonModule, fn: JitFn, consts: dict[str, object]) -> TileWalk:
    body = specialize(copy.deepcopy(fn.node.body), dict(consts), mod, calls=True)
    return walk_tiles(mod, fn, body, consts)


def _top_kernels(mod: TritonModule) -> list[JitFn]:
    called = {n.func.id for f in mod.jit.values() for n in ast.walk(f.node)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return [fn for fn in mod.jit.values() if fn.name not in called]


_WALK_ERRORS = (RecursionError, KBError, KeyError, ValueError, TypeError, IndexError, Unknown, AttributeError)


def lift_backward(mod: TritonModule, base: Provenance, family: str) -> BackwardReport:
    """Backward and delta kernels of `mod`, recognised by dataflow; the rest is left to the forward lifter."""
    rep = BackwardReport()
    kinds: dict[str, tuple[JitFn, str, TileWalk]] = {}
    for fn in _top_kernels(mod):
        fixed, enumerated = _flags(fn, mod)
        try:
            walk = _walk(mod, fn, {**fixed, **{e: False for e in enumerated}})
        except _WALK_ERRORS as err:
            log.debug("tile walk of %s failed: %s", fn.name, err)
            continue
        if (kind := kind_of(walk)) is not None:
            kinds[fn.name] = (fn, kind, walk)
            rep.handled.add(fn.name)
    deltas = _deltas(rep, [(fn, walk) for fn, kind, walk in kinds.values() if kind == "delta"])
    parts: list[_Part] = []
    for fn, kind, _ in kinds.values():
        if kind == "backward":
            parts += _parts(rep, mod, fn)
    _programs(rep, mod, base, family, parts, deltas)
    return rep


def _deltas(rep: BackwardReport, found: list[tuple[JitFn, TileWalk]]) -> list[_DeltaKernel]:
    out = []
    for fn, walk in found:
        try:
            kernel, d, spans = _delta(walk, fn)
        except Refuse as why:
            rep.skipped.append((fn.name, f"delta kernel not lifted: {why}"))
            rep.coverage.append((fn.name, f"delta kernel not lifted: {why}"))
            continue
        out.append(_DeltaKernel(fn, kernel, d, spans))
        rep.coverage.append((fn.name, "delta kernel: the bwd_preprocess of the backward programs"))
    return out


def _parts(rep: BackwardReport, mod: TritonModule, fn: JitFn) -> list[_Part]:
    """Every flag combination of a backward kernel as a KV-outer part or a dQ pass (or the reason it is neither)."""
    fixed, enumerated = _flags(fn, mod)
    out, skips = [], []
    for values in itertools.product((False, True), repeat=len(enumerated)):
        flags = dict(zip(enumerated, values))
        label = ",".join(f"{k}={v}" for k, v in flags.items()) or "default"
        try:
            walk = _walk(mod, fn, {**fixed, **flags})
            if walk.unknown:
                raise Refuse("constructs not understood: " + "; ".join(f"line {ln}: {w}" for ln, w in walk.unknown[:3]))
            out.append(_part(walk, fn, flags))
        except Refuse as why:
            skips.append((f"{fn.name}[{label}]", str(why)))
        except _WALK_ERRORS as err:
            skips.append((f"{fn.name}[{label}]", f"lifter error: {type(err).__name__}: {err}"))
    merged = merge_skips(fn.name, skips)
    rep.skipped += merged
    rep.coverage += [(what, f"not lifted: {why}") for what, why in merged]
    return out


def _part(walk: TileWalk, fn: JitFn, flags: dict[str, bool]) -> _Part:
    try:
        return _kv_outer(walk, fn, flags)
    except Refuse as kv_why:
        try:
            return _dq_pass(walk, fn, flags)
        except Refuse as dq_why:
            if "no dV" in str(kv_why) or "no dK" in str(kv_why):
                raise Refuse(f"{kv_why}, and it is no dQ pass: {dq_why}") from None
            raise kv_why from None


def _programs(rep: BackwardReport, mod: TritonModule, base: Provenance, family: str, parts: list[_Part],
              deltas: list[_DeltaKernel]) -> None:
    passes = [p for p in parts if p.kernel.name == "bwd_dq"]
    used: set[int] = set()
    for part in (p for p in parts if p.kernel.name == "bwd_dkdv"):
        label = ",".join(f"{k}={v}" for k, v in part.flags.items()) or "default"
        notes: list[str] = []
        try:
            dq = None if part.accumulates_dq else _pair(part, passes)
            pre = _pick_delta(mod, part, deltas, notes)
        except Refuse as why:
            rep.skipped.append((f"{part.fn.name}[{label}]", str(why)))
            rep.coverage.append((f"{part.fn.name}[{label}]", f"not lifted: {why}"))
            continue
        used |= {id(dq)} if dq is not None else set()
        tunables = _tunables(mod, part, dq, base, family)
        rep.tunables += [t for t in tunables if t not in rep.tunables]
        schedule, sched_note = _schedule(tunables, part.flags)
        name = f"{family}_{part.fn.name.strip('_')}" + "".join(f"_{k.lower()}" for k, v in part.flags.items() if v)
        prog = _program(name, pre, part, dq, schedule)
        notes = [sched_note, *notes, *part.notes, *(dq.notes if dq is not None else [])]
        spans = pre.spans + part.spans + (dq.spans if dq is not None else [])
        lifted = _checked(rep, mod, part, prog, notes, spans, base, family, tunables)
        status = f"lifted: {name}" + (f" (dQ pass {dq.fn.name})" if dq is not None else "")
        rep.coverage.append((f"{part.fn.name}[{label}]", status if lifted is not None else "not lifted: see skipped"))
        if lifted is not None:
            rep.programs.append(lifted)
    for p in passes:
        if id(p) not in used:
            label = ",".join(f"{k}={v}" for k, v in p.flags.items()) or "default"
            rep.coverage.append((f"{p.fn.name}[{label}]", "dQ pass with no KV-outer kernel of the same masks"))
        else:
            rep.coverage.append((f"{p.fn.name}[{','.join(f'{k}={v}' for k, v in p.flags.items()) or 'default'}]",
                                 "dQ pass: the bwd_dq kernel of a program above"))


def _pair(part: _Part, passes: list[_Part]) -> _Part:
    """The dQ pass with the same masks, score terms and flag values as a KV-outer part that does not update dQ."""
    fits = [p for p in passes if p.masks == part.masks and p.score == part.score and p.gqa == part.gqa
            and all(p.flags.get(k, v) == v for k, v in part.flags.items())]
    if not fits:
        raise Refuse(f"dQ is not updated in {part.fn.name} and no dQ pass kernel in the file has its masks "
                     f"{[str(m) for m in part.masks]}")
    return fits[0]


def _schedule(tunables: list[LiftedTunable], flags: dict[str, bool]) -> tuple[Schedule, str]:
    """The autotune config whose flag values (e.g. SEQUENCE_PARALLEL) match this combination, else the launch's."""
    fits = [t for t in tunables if all(t.params.get(k.lower(), v) == v for k, v in flags.items())
            and isinstance(t.params.get("block_m"), int) and isinstance(t.params.get("block_n"), int)]
    if not fits:
        return Schedule(block_m=64, block_n=64, num_warps=4, num_stages=1), "no config found: 64x64 default"
    t = fits[0]
    nw, ns = t.params.get("num_warps", 4), t.params.get("num_stages", 1)
    return (Schedule(block_m=as_int(t.params["block_m"]), block_n=as_int(t.params["block_n"]),
                     num_warps=nw if isinstance(nw, int) else 4, num_stages=ns if isinstance(ns, int) else 1),
            f"schedule from {t.condition} (line {t.provenance.line_start})")


def _tunables(mod: TritonModule, part: _Part, dq: _Part | None, base: Provenance, family: str) -> list[LiftedTunable]:
    """Autotune configs and launch constants of the kernels, block sizes named by use (q-row and kv-row extents)."""
    out = []
    for p in (part, dq) if dq is not None else (part,):
        keys = _block_keys(p)
        prov = replace(base, lifter="triton", lifter_version=BWD_LIFTER_VERSION)
        for c in mod.configs:
            if c.function == p.fn.name:
                params = {keys.get(k, k.lower()): v for k, v in c.params.items()} | {"direction": "backward"}
                out.append(LiftedTunable(family, "any", 0, "any", params, f"{p.fn.name} autotune config",
                                         replace(prov, line_start=c.line, line_end=c.line)))
        for site in mod.launches:
            if site.kernel == p.fn.name:
                params = _launch_params(mod, p, site, keys)
                if params:
                    out.append(LiftedTunable(family, "any", 0, "any", params | {"direction": "backward"},
                                             f"launch of {p.fn.name}", replace(prov, line_start=site.line, line_end=site.line)))
    return out


def _launch_params(mod: TritonModule, p: _Part, site, keys: dict[str, str]) -> dict[str, object]:
    """Block sizes, warps and stages at a launch: keywords, or positional launcher locals (`BM, BN = 32, 128`)."""
    local = _launcher_literals(mod, site.line)
    given = {**{a.arg: local.get(name) for a, name in zip(p.fn.node.args.args, site.args) if name is not None},
             **{k: local.get(v, site.constants.get(k)) for k, v in site.keyword_exprs.items()},
             **site.constants}
    out = {keys[k]: v for k, v in given.items() if k in keys and isinstance(v, int)}
    return out | {k: v for k, v in given.items() if k in ("num_warps", "num_stages", "waves_per_eu") and isinstance(v, int)}


def _launcher_literals(mod: TritonModule, line: int) -> dict[str, object]:
    """Literal values of the launcher's locals, through tuple assignments (`BLOCK_M1, BLOCK_N1 = 32, 128`)."""
    for fn in ast.walk(mod.tree):
        if isinstance(fn, ast.FunctionDef) and fn.lineno <= line <= (fn.end_lineno or fn.lineno) and fn.name not in mod.jit:
            out: dict[str, object] = {}
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and len(n.targets) == 1:
                    targets = n.targets[0].elts if isinstance(n.targets[0], ast.Tuple) else [n.targets[0]]
                    values = n.value.elts if isinstance(n.value, ast.Tuple) else [n.value]
                    for t, v in zip(targets, values) if len(targets) == len(values) else ():
                        if isinstance(t, ast.Name) and isinstance(v, ast.Constant) and isinstance(v.value, int):
                            out[t.id] = v.value
            return out
    return {}


def _block_keys(p: _Part) -> dict[str, str]:
    return {"BLOCK_M": "block_m", "BLOCK_N": "block_n", **p.extents}


def _checked(rep: BackwardReport, mod: TritonModule, part: _Part, prog: Program, notes: list[str], spans: list,
             base: Provenance, family: str, tunables: list[LiftedTunable]) -> LiftedProgram | None:
    label = ",".join(f"{k}={v}" for k, v in part.flags.items()) or "default"
    try:
        validate(prog)
    except KBError as err:
        rep.skipped.append((f"{part.fn.name}[{label}]", f"lifted program fails validation: {err}"))
        return None
    ok, note = verify_backward(prog, gqa=part.gqa)
    _add_spans(rep, prog, spans, base, mod)
    if not ok:
        rep.skipped.append((f"{part.fn.name}[{label}]", f"interpreter check failed: {note}"))
        return None
    fn = part.fn
    prov = replace(base, line_start=fn.node.lineno, line_end=fn.node.end_lineno or fn.node.lineno, lifter="triton",
                   lifter_version=BWD_LIFTER_VERSION)
    feats = derive_features(prog)
    if any(v and "ALIBI" in k for k, v in part.flags.items()):  # as the forward lifter: the flag names the variant
        feats = replace(feats, alibi=True)
    return LiftedProgram(prog.name, family, prog, prov, tuple(tunables), ok, note, feats,
                         tuple(part.flags.items()), tuple(notes))


def _add_spans(rep: BackwardReport, prog: Program, spans: list, base: Provenance, mod: TritonModule) -> None:
    seen = {(s.kind, s.provenance.file, s.provenance.line_start, s.provenance.line_end) for s in rep.snippets}
    for kind, ir, start, end, file in spans:
        file = file or base.file
        if (kind, file, start, end) in seen or start <= 0:
            continue
        seen.add((kind, file, start, end))
        prov = replace(base, file=file, line_start=start, line_end=end, lifter="triton", lifter_version=BWD_LIFTER_VERSION)
        feats: dict[str, object] = {"backward": True}
        if prog.mask_mod is not None:
            feats["causal"] = True
        rep.snippets.append(LiftedSnippet(kind, f"{kind.replace('_', ' ')} ({file.rsplit('/', 1)[-1]}:{start})", ir,
                                          _excerpt(mod, base, file, start, end), feats, prov))


def _excerpt(mod: TritonModule, base: Provenance, file: str, start: int, end: int) -> str:
    lines = mod.lines
    if file != base.file:
        p = mod.path.parent / file.rsplit("/", 1)[-1]
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines() if p.exists() else []
    return "\n".join(lines[start - 1:end])
