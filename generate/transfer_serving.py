"""Transfer onto a serving spec: a lifted paged-KV decode program (vLLM, SGLang) gets the spec's variant slots.

The reference keeps its layout (token pool or page table, per-lane gathers, split-KV and combine); what changes:
- its page table and length params take the spec's input names (`req_to_tokens` -> `block_table`,
  `b_seqlen` -> `seq_lens`), so the operator passes the engine's tensors as they are;
- its aux tensors of its own variant go, the spec's come in (ALiBi slopes, sinks);
- mask_mod and score_mod are the spec's (its mask_mod holds the sequence's bound `kv_idx < seq_lens[b]`);
- scores are placed at the spec's dense view: decode has one query row, q_idx = 0 (the lifted programs pass
  the query's position `kv_len - 1`, which their own mask never reads). A reference whose tile rows are the
  query heads of a KV group (vLLM/SGLang's grouped kernels: K/V read once per group) places them with its rows as
  heads (`TileAt.head_rows`: row i is head h0 + i), so a variant reading `h` (ALiBi slopes, per-head tables) gets
  each row's head.
- sinks (`Spec.sinks`): the online softmax starts at m = sinks[h], l = 1 in the split that holds the
  sequence's first key (only there, so the combine counts the sink once); on a grouped tile each row starts at
  its own head's sink (a [BLOCK_M] tile of sinks loaded over the q tile's head span);
- a sliding window of constant width reads the same few KV blocks whatever the context, so the split count keeps
  each split at least the split rule's minimum of KV blocks (`_window_splits`): one split for a 128-key window.
A packed varlen or chunked prefill spec takes a lifted packed prefill instead (`_transfer_packed`): its query rows
come from the spec's offsets, its keys from the packed keys or, for a chunked prefill, from the paged cache
gathered as the decode programs gather it; with sinks, each query block's softmax starts at its head's sink.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import replace
from collections.abc import Mapping
from typing import Any, Callable

from generate.spec_serving import ServingLayout, length_input
from generate.transfer import Strategy, Target, rewrite_loop_body
from kb.errors import KBError
from kb.ir.algebra import conjuncts, simplify
from kb.ir.expr import Expr, ExprOp, call, const, free_vars, load, loaded_tensors, var
from kb.ir.nodes import (
    Dtype, Elementwise, For, Gather, Init, Kernel, Let, Load, Mask, OnlineSoftmax, Param, Program, Role, Schedule, ScoreMod, Span, Stmt,
    TileAt, VariantFn, MASK_MOD_PARAMS, SCORE_MOD_PARAMS, walk_stmts,
)
from kb.ir.rename import fresh, keep_apart, local_names, names, rename
from kb.ir.rewrite import map_stmts
from kb.ir.window import first_key, window_width
from kb.lower.triton_preamble import _MIN_SPLIT_BLOCKS as MIN_SPLIT_BLOCKS  # the generated modules' split rule

__all__ = ["transfer_serving", "fits_layout", "groups_heads", "serving_params", "SERVING_STRATEGY"]

SERVING_STRATEGY = "serving"  # the attempt's strategy name: the reference's layout kept, its variant slots filled

_FLOATS = (Dtype.F32, Dtype.BF16, Dtype.F16)


def serving_params(reference: Program) -> tuple[str, str]:
    """(table, lengths) of a lifted decode program: its 2-D integer aux (the page table / req_to_token) and the
    [B] aux its mask_mod bounds keys by (`kv_idx < lengths[b]`, generate.spec_serving.length_input); KBError when it
    has not exactly one of each."""
    tables = [p.name for p in reference.params if p.role is Role.AUX and len(p.shape) == 2
              and p.dtype in (Dtype.I32, Dtype.I64)]
    bound = reference.mask_mod.body if reference.mask_mod is not None else None
    lengths = [n for t in (conjuncts(bound) if bound is not None else ()) if (n := length_input(t)) is not None]
    if len(tables) != 1 or len(lengths) != 1:
        raise KBError(f"reference {reference.name} is not a paged decode program (tables {tables}, lengths {lengths})")
    return tables[0], lengths[0]


def _head_rows(kernel: Kernel) -> Span | None:
    """The head span of the kernel's q tile when it spans several query heads (a GQA group packed into the tile
    rows), else None."""
    for st in walk_stmts(kernel.body):
        if isinstance(st, Load) and st.tensor == "q" and len(st.index) > 1 and isinstance(st.index[1], Span):
            return st.index[1] if st.index[1].size != 1 else None
    return None


def groups_heads(reference: Program) -> bool:
    """Does a kernel of `reference` put a GQA group's query heads in its tile rows (K/V read once per group)?"""
    return any(_head_rows(k) is not None for k in reference.kernels)


def _decode_at(at: TileAt, head_rows: bool) -> TileAt:
    return TileAt(at.b, at.h, const(0), at.kv_start, head_rows=head_rows)


def _with_sink(kernel: Kernel, sinks: str | None, lo: Expr, taken: frozenset[str] = frozenset()) -> Kernel:
    """m starts at sinks[h] and l at 1 where this program's KV range starts at the sequence's first key (`lo == 0`);
    without sinks, at -inf and 0 (a reference generated for a spec with sinks started at its own). On a grouped
    tile (rows are heads) m starts from a tile of sinks over the rows' heads; rows past the group read -inf."""
    first = lo.eq(0) if lo != const(0) else None
    states = {(st.m, st.l) for st in walk_stmts(kernel.body) if isinstance(st, OnlineSoftmax)}
    if len(states) != 1:
        raise KBError(f"kernel {kernel.name}: sinks need one online softmax state")
    ((m, l),) = states
    rows = _head_rows(kernel) if sinks is not None else None
    sink = load(sinks, var("h")) if sinks is not None and rows is None else None
    tile = fresh("sink_rows", taken) if rows is not None else ""

    def start(st: Stmt) -> Stmt | tuple[Stmt, ...]:
        if not (isinstance(st, Init) and st.out in (m, l)):
            return st
        if sinks is None:
            return replace(st, fill=float("-inf") if st.out == m else 0.0)
        empty = const(float("-inf") if st.out == m else 0.0)  # another split starts empty: the sink is counted once
        if st.out == l:
            return replace(st, fill=1.0 if first is None else call("where", first, const(1.0), empty))
        if rows is not None:
            m0 = var(tile) if first is None else call("where", first, var(tile), var(m))
            return (replace(st, fill=float("-inf")), Load(tile, sinks, (rows,), other=float("-inf")), Elementwise(m, m0))
        assert sink is not None  # sinks given, one head per tile
        return replace(st, fill=sink if first is None else call("where", first, sink, empty))

    return replace(kernel, body=map_stmts(kernel.body, start))


def _rewrite(kernel: Kernel, target: Target, sinks: str | None, taken: frozenset[str]) -> Kernel:
    loops = [st for st in kernel.body if isinstance(st, For) and any(isinstance(s, OnlineSoftmax) for s in walk_stmts(st.body))]
    if not loops:
        return kernel  # the split-KV combine: nothing variant-specific
    grouped = _head_rows(kernel) is not None
    if len(loops) > 1:
        raise KBError(f"kernel {kernel.name} has {len(loops)} KV loops; a serving transfer takes one")
    (loop,) = loops
    kernel, loop = _without_window_start(kernel, loop)
    at = next((_decode_at(st.at, grouped) for st in walk_stmts(loop.body) if isinstance(st, (Mask, ScoreMod))), None)
    if at is None:
        raise KBError(f"kernel {kernel.name}: its KV loop applies no mask; cannot place the sequence's bound")
    new_loop = replace(loop, body=rewrite_loop_body(loop.body, target, Strategy.REUSE, at))
    lets: tuple[Stmt, ...] = ()
    first = first_key(target.mask_mod, at)
    if first is not None:  # a window: start each split's loop at the KV block of the first key the query can see
        name = fresh("kv_first", taken)
        lets = (Let(name, first),)
        # split ranges are whole KV blocks from lo: a start inside a block would let its last block reach into the
        # next split's keys (loads past the split's end are bounded by the sequence, not the split)
        step = var(loop.step) if isinstance(loop.step, str) else const(loop.step)
        block = var(name) // step * step
        new_loop = replace(new_loop, lo=call("maximum", loop.lo, block))
    i = kernel.body.index(loop)
    kernel = replace(kernel, body=kernel.body[:i] + lets + (new_loop,) + kernel.body[i + 1:])
    return _with_sink(kernel, sinks, loop.lo, taken)


def _without_window_start(kernel: Kernel, loop: For) -> tuple[Kernel, For]:
    """A reference generated for a windowed spec starts its KV loop at `maximum(lo, kv_first // BLOCK_N * BLOCK_N)`
    after `let kv_first = ...` (what `_rewrite` writes): both go, so the loop starts at its split's start again and
    the sink's first-split test reads only names defined before it; the target's own window, if any, is placed anew."""
    lo = loop.lo
    if not (isinstance(lo, Expr) and lo.op is ExprOp.MAXIMUM):
        return kernel, loop
    i = kernel.body.index(loop)
    before = kernel.body[i - 1] if i else None
    if not (isinstance(before, Let) and before.name in free_vars(lo.args[1])
            and before.name not in free_vars(lo.args[0])):
        return kernel, loop
    bare = replace(loop, lo=lo.args[0])
    return replace(kernel, body=kernel.body[:i - 1] + (bare,) + kernel.body[i + 1:]), bare


def _window_splits(schedule: Schedule, mask: Expr | None, lengths: str) -> Schedule:
    """`schedule` with no more splits than leave each one `MIN_SPLIT_BLOCKS` KV blocks of a window of constant width
    (cdiv(width, BLOCK_N) + 1 blocks: its start need not sit on a block), as the split rule caps a dense decode's.
    Measured (run 26, H100, gpt-oss heads, 128-key window + sinks, CUDA-graph replay): 3 splits 0.0238 / 0.0605 ms at
    batch 64 / 256, 1 split 0.0210 / 0.0514 (vLLM's unified_attention 0.0187 / 0.0506)."""
    width = window_width(mask, lengths)
    if width is None:
        return schedule
    blocks = -(-width // schedule.block_n) + 1
    return replace(schedule, num_splits=max(1, min(schedule.num_splits, blocks // MIN_SPLIT_BLOCKS)))


def _map_exprs(node: Any, f: Callable[[Expr], Expr]) -> Any:
    """`node` (a statement, index item or TileAt; nested bodies included) with `f` applied to each expression in it."""
    if isinstance(node, Expr):
        return f(node)
    if isinstance(node, tuple):
        return tuple(_map_exprs(x, f) for x in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {fl.name: _map_exprs(getattr(node, fl.name), f) for fl in dataclasses.fields(node)}
        return replace(node, **changes)
    return node


def _varlen_params(reference: Program) -> tuple[str, str, str]:
    """(starts, lengths, max length) of a lifted packed prefill: its [B] integer aux tables, lengths the one its
    mask_mod bounds keys by, and its integer scalar sizing the query-block grid; KBError otherwise."""
    ints = [p.name for p in reference.params if p.role is Role.AUX and len(p.shape) == 1
            and p.dtype in (Dtype.I32, Dtype.I64)]
    bound = reference.mask_mod.body if reference.mask_mod is not None else None
    lengths = [n for t in (conjuncts(bound) if bound is not None else ()) if (n := length_input(t)) is not None]
    scalars = [p.name for p in reference.params if p.role is Role.SCALAR and p.dtype in (Dtype.I32, Dtype.I64)]
    q = reference.param("q") if "q" in {p.name for p in reference.params} else None
    if q is None or len(q.shape) != 3 or len(ints) != 2 or len(lengths) != 1 or lengths[0] not in ints or len(scalars) != 1:
        raise KBError(f"reference {reference.name} is not a packed varlen prefill program (token-major q, a [B] start "
                      f"and length table, one integer max length)")
    return next(n for n in ints if n != lengths[0]), lengths[0], scalars[0]


def _per_sequence(target: Target, layout: ServingLayout, derived: Mapping[str, tuple[str, bool]],
                  keep: frozenset[str] = frozenset()) -> Target | None:
    """A varlen spec's variants as they read inside the kernel of sequence `b`: the spec writes them over the dense
    view (B = 1, global token positions) and finds a token's sequence through ids = searchsorted(cu_seqlens, x,
    right=True); every query and key a packed program's tile holds belongs to its sequence b, so those ids read
    b + 1 (six gathers per score become scalars of the program), and keys past the sequence's end, which the ids
    used to mask, are bounded by `kv_idx < cu_k[b + 1]`. None when the spec's expressions read the dense batch `b`
    (always 0) or no ids. Aux tensors the variants no longer read go, except those in `keep` (the sinks)."""
    cu_q, cu_k = layout.table, layout.table_k or layout.table
    ids = {n for n, (src, right) in derived.items() if right and src in (cu_q, cu_k)}
    exprs = [e for e in (target.score_mod, target.mask_mod) if e is not None]
    if not ids or any("b" in free_vars(e) for e in exprs):
        return None
    seq = var("b") + 1

    def read(e: Expr) -> Expr:
        args = tuple(read(a) for a in e.args)
        if e.op is ExprOp.LOAD and e.value in ids and len(args) == 1:
            return seq
        return Expr(e.op, args, e.value) if args != e.args else e

    score = simplify(read(target.score_mod)) if target.score_mod is not None else None
    bound = var("kv_idx") < load(cu_k, seq)
    mask = bound
    if target.mask_mod is not None:  # `ids[q_idx] == ids[kv_idx]` (one sequence) now reads b + 1 == b + 1: dropped
        kept = [t for t in conjuncts(simplify(read(target.mask_mod))) if not (t.op is ExprOp.EQ and t.args[0] == t.args[1])]
        mask = functools.reduce(operator.and_, [*kept, bound])
    used = set(keep).union(*(loaded_tensors(e) for e in (score, mask) if e is not None))
    return replace(target, score_mod=score, mask_mod=mask, aux=tuple(a for a in target.aux if a.name in used))


def _transfer_packed(reference: Program, layout: ServingLayout, target: Target, name: str | None,
                     causal: bool, derived: Mapping[str, tuple[str, bool]], sinks: str | None) -> Program:
    """A lifted packed prefill (q, k, v share one start/length table: self-attention packing) over the spec's packed
    queries, q rows from cu_q[b] (cu_seqlens_q; a chunked prefill's query_start_loc), each query block visiting its
    sequence's keys up to its diagonal when `causal` (bottom-right: kv <= q + max(0, k_len - q_len)), else all (the
    reference's KV bound assumes equal lengths). The keys are
    - varlen: packed rows from cu_k[b] with their own lengths, scores placed at the dense view's global token
      positions (B = 1), where the spec's expressions are written;
    - chunked: the sequence's seq_lens[b] keys gathered from the cache's token rows through block_table
      (row = PAGE_SIZE * block_table[b, n // PAGE_SIZE] + n % PAGE_SIZE, as vLLM's decode reads them), scores
      placed at (b, row in the chunk, key position)."""
    starts, lengths, _ = _varlen_params(reference)
    chunked = layout.kind == "chunked"
    cu_q = layout.q_offsets if chunked else layout.table
    cu_k = layout.table_k or layout.table
    assert cu_q is not None and cu_k is not None
    if chunked and layout.lengths is None:
        raise KBError("serving transfer: a chunked prefill spec must bound each sequence's keys (`kv_idx < seq_lens[b]`)")
    b = var("b")
    after = b + 1
    local = None if chunked else _per_sequence(target, layout, derived, frozenset(() if sinks is None else (sinks,)))
    target = local or target

    def offsets(e: Expr) -> Expr:
        args = tuple(offsets(a) for a in e.args)
        if e.op is ExprOp.LOAD and e.value in (starts, lengths) and len(args) == 1:
            if e.value == starts:
                return load(cu_q, args[0])
            return load(cu_q, args[0] + 1) - load(cu_q, args[0])
        return Expr(e.op, args, e.value) if args != e.args else e

    taken = set(names(reference)) | {cu_q, cu_k} | {a.name for a in target.aux}
    k0, k_len, page, j = (fresh(n, taken | {"k0", "k_len", "PAGE_SIZE"} - {n}) for n in ("k0", "k_len", "PAGE_SIZE", "j"))

    def key_rows(span: Span, n: Expr) -> Span | Gather:
        if not chunked:
            return Span(var(k0) + n, span.size, var(k0) + var(k_len))
        pos = n + var(j)
        slot = load(layout.table, b, pos // var(page))
        row = pos % var(page) + var(page) * slot
        return Gather(j, span.size, row, pos < var(k_len))

    def kernel(k: Kernel) -> Kernel:
        k = replace(k, body=_map_exprs(k.body, offsets))
        loops = [st for st in k.body if isinstance(st, For) and any(isinstance(s, OnlineSoftmax) for s in walk_stmts(st.body))]
        if not loops:
            return k
        if len(loops) > 1:
            raise KBError(f"kernel {k.name} has {len(loops)} KV loops; a packed prefill transfer takes one")
        (loop,) = loops
        n = var(loop.var)

        def keys(st: Stmt) -> Stmt:
            if isinstance(st, Load) and st.tensor in ("k", "v") and isinstance(st.index[0], Span):
                return replace(st, index=(key_rows(st.index[0], n),) + st.index[1:])
            if isinstance(st, (Mask, ScoreMod)) and not chunked:
                at = st.at
                return replace(st, at=TileAt(b if local else const(0), at.h, load(cu_q, b) + at.q_start, var(k0) + at.kv_start))
            return st

        at = next((st.at for st in walk_stmts(loop.body) if isinstance(st, (Mask, ScoreMod))), None)
        if at is None:
            raise KBError(f"kernel {k.name}: its KV loop applies no mask; cannot place the sequence's bound")
        inner = rewrite_loop_body(loop.body, target, Strategy.REUSE, at)
        # a query block past its sequence's end (the grid covers the longest) visits no key
        q_len = load(cu_q, after) - load(cu_q, b)
        keys_hi: Expr = var(k_len)
        if causal:
            shift = call("maximum", const(0), var(k_len) - q_len)
            keys_hi = call("minimum", var(k_len), at.q_start + var("BLOCK_M") + shift)
        hi = call("where", at.q_start < q_len, keys_hi, const(0))
        new_loop = replace(loop, lo=const(0), hi=hi, body=map_stmts(inner, keys))
        lets = (Let(k_len, load(layout.lengths, b)),) if chunked else (  # type: ignore[arg-type]
            Let(k0, load(cu_k, b)), Let(k_len, load(cu_k, after) - load(cu_k, b)))
        k = replace(k, body=lets + tuple(new_loop if st is loop else st for st in k.body))
        return _with_sink(k, sinks, const(0), frozenset(taken)) if sinks is not None else k

    if chunked:
        # packed query tokens T (q, o, lse); the cache's token rows (k, v; a paged cache's flatten(0, 1))
        rows = fresh("ROWS", taken)
        tokens = {"q": "T", "o": "T", "lse": "T", "k": rows, "v": rows}
        added = [Param(cu_q, (f"{cu_q}_n0",), Dtype.I32, Role.AUX),
                 Param(layout.table, ("B", fresh("MAX_PAGES", taken)), Dtype.I32, Role.AUX),
                 Param(layout.lengths, ("B",), Dtype.I32, Role.AUX), Param(page, (), Dtype.I32, Role.SCALAR)]  # type: ignore[arg-type]
        batches: Expr = var("B")
    else:
        # the dense view's dims: M packed queries (q, o, lse), N packed keys (k, v), so rows and keys past them are
        # out of range as the spec's tables indexed by q_idx / kv_idx are
        tokens = {"q": "M", "o": "M", "lse": "M", "k": "N", "v": "N"}
        added = [Param(t, (f"{t}_n0",), Dtype.I32, Role.AUX) for t in dict.fromkeys((cu_q, cu_k))]
        batches = var(f"{cu_q}_n0") - 1

    params = [replace(p, shape=(tokens[p.name], *p.shape[1:])) if p.name in tokens else p
              for p in reference.params if p.name not in (starts, lengths)]
    params = [replace(p, dtype=target.out_dtype if p.role is Role.OUT and target.out_dtype else target.dtype)
              if p.role in (Role.IN, Role.OUT) and p.dtype in _FLOATS and p.name != "lse" else p for p in params]
    have = {p.name for p in params}
    extra = {a.name: a for a in (*added, *target.aux)}  # the spec's own shapes win
    params += [a for a in extra.values() if a.name not in have]
    kernels = tuple(kernel(k) for k in reference.kernels)
    kernels = tuple(replace(k, grid=tuple(replace(ax, extent=batches) if ax.name == "b" else ax for ax in k.grid))
                    for k in kernels)
    return Program(
        name=name or f"{reference.name}__serving",
        params=tuple(params),
        schedule=replace(reference.schedule, head_pad=0),
        kernels=kernels,
        score_mod=VariantFn("score_mod", SCORE_MOD_PARAMS, target.score_mod) if target.score_mod is not None else None,
        mask_mod=VariantFn("mask_mod", MASK_MOD_PARAMS, target.mask_mod) if target.mask_mod is not None else None,
    )


def fits_layout(reference: Program, layout: ServingLayout) -> bool:
    """Is `reference` a program of the layout transfer_serving writes for `layout` (a page-table decode for paged and
    token-pool specs, a start/length-table packed prefill for varlen and chunked ones)?"""
    try:
        if layout.kind in ("varlen", "chunked"):
            _varlen_params(reference)
        else:
            serving_params(reference)
    except KBError:
        return False
    return True


def transfer_serving(reference: Program, layout: ServingLayout, target: Target, *, sinks: str | None = None,
                     name: str | None = None, causal: bool = False,
                     derived: Mapping[str, tuple[str, bool]] | None = None) -> Program:
    """The lifted serving program `reference` computing the spec's variant over the spec's own inputs; `causal`: the
    spec's mask is causal (generate.spec classifies it), so a packed prefill's query block skips the keys past its
    diagonal; `derived` (Spec.derived_aux): the aux tensors the candidate computes from an input (sequence ids)."""
    if layout.kind in ("varlen", "chunked"):
        if sinks is not None and sinks not in {a.name for a in target.aux}:
            raise KBError(f"serving transfer: the sink tensor {sinks!r} is not among the spec's aux tensors")
        return _transfer_packed(reference, layout, target, name, causal, derived or {}, sinks)
    if layout.lengths is None:
        raise KBError("serving transfer: the spec bounds no sequence's keys (`kv_idx < seq_lens[b]`); a paged decode "
                      "kernel reads each sequence's keys up to its length")
    table, lengths = serving_params(reference)
    claimed = {a.name for a in target.aux} | set(target.scalars) | {layout.table, layout.lengths} - {"sm_scale"}
    reference = keep_apart(reference, claimed)
    renames = {old: new for old, new in ((table, layout.table), (lengths, layout.lengths)) if old != new}
    taken = frozenset(p.name for p in reference.params)
    for old, new in renames.items():
        if new in taken:
            raise KBError(f"reference {reference.name} has a param {new!r} of its own; cannot name its {old} so")
    reference = rename(reference, renames)
    keep = {layout.table, layout.lengths}
    params: list[Param] = []
    for p in reference.params:
        if p.role is Role.AUX and p.name not in keep:
            continue  # the reference's own variant
        if p.role in (Role.IN, Role.OUT) and p.dtype in _FLOATS and p.name != "lse":
            p = replace(p, dtype=target.out_dtype if p.role is Role.OUT and target.out_dtype else target.dtype)
        params.append(p)
    names = {p.name for p in params}
    params += [Param(s, (), Dtype.F32, Role.SCALAR) for s in target.scalars if s not in names]
    params += [a for a in target.aux if a.name not in names]
    if sinks is not None and sinks not in {p.name for p in params}:
        raise KBError(f"serving transfer: the sink tensor {sinks!r} is not among the spec's aux tensors")
    taken = local_names(reference) | {p.name for p in params} | set(SCORE_MOD_PARAMS)
    return Program(
        name=name or f"{reference.name}__serving",
        params=tuple(params),
        schedule=_window_splits(replace(reference.schedule, head_pad=0), target.mask_mod, layout.lengths),
        kernels=tuple(_rewrite(k, target, sinks, taken) for k in reference.kernels),
        score_mod=VariantFn("score_mod", SCORE_MOD_PARAMS, target.score_mod) if target.score_mod is not None else None,
        mask_mod=VariantFn("mask_mod", MASK_MOD_PARAMS, target.mask_mod) if target.mask_mod is not None else None,
    )
