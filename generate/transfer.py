"""Rule-based transfer: adapt a reference Program to a target spec.

The reference decides the code shape (kernels, loads, schedule, softmax structure); the
target fills the variant slots (and, for MLA-style value heads, gives v and o their own head
dim `Dv`: kb.ir.value_dim). How the KV loop is bounded is the risky part of a
transfer, so it is an explicit `Strategy`, tried in order and remembered as a lesson:

- REUSE: keep the reference's loop bounds and block tests (right when the masks agree).
- DERIVE: bounds derived from the target mask (causal / sliding window block skipping).
- BLOCK_MASK: bounds from the mask's static terms only (else the full KV range); runtime
  block classes skip empty blocks and unmask full ones (the FlexAttention strategy).
DERIVE and BLOCK_MASK classify mask constants at the spec's lengths (`Target.dims`).

Every function here is `Program -> Program` (or builds a Program); nothing is mutated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from kb.errors import KBError
from kb.ir.algebra import conjuncts
from kb.ir.expr import Expr, ExprOp, call, const, free_vars, loaded_tensors, parse_expr, substitute, var
from kb.ir.nodes import (
    BlockClass, Dot, Dtype, Elementwise, For, IfBlock, Kernel, Let, Load, Mask, OnlineSoftmax, Param, Program,
    Role, ScoreMod, Span, Stmt, TileAt, VariantFn, MASK_MOD_PARAMS, SCORE_MOD_PARAMS, walk_stmts,
)
from kb.ir.rename import keep_apart
from kb.ir.rewrite import map_stmts, without_tests
from kb.ir.value_dim import with_value_dim, without_value_dim

__all__ = ["Strategy", "Target", "transfer", "rewrite_loop_body", "STRATEGY_ORDER"]


class Strategy(Enum):
    REUSE = "reuse"
    DERIVE = "derive"
    BLOCK_MASK = "block_mask"


STRATEGY_ORDER = (Strategy.REUSE, Strategy.DERIVE, Strategy.BLOCK_MASK)


@dataclass(frozen=True)
class Target:
    """What a transfer needs to know about the spec."""

    score_mod: Expr | None
    mask_mod: Expr | None
    dtype: Dtype  # of the inputs q, k, v
    out_dtype: Dtype | None = None  # of the output o, when the spec returns another dtype than it takes
    aux: tuple[Param, ...] = ()  # AUX params the variant functions load from
    scalars: tuple[str, ...] = ()  # scalar params the variant functions use
    dims: tuple[int, int] | None = None  # the spec's (M, N): mask constants are classified at these lengths
    block_m: int | None = None  # schedule override (e.g. a tunable for the target head dim)
    block_n: int | None = None
    value_dim: bool = False  # v and o have a head dim Dv of their own (D_v != D_qk)
    extras: dict = field(default_factory=dict, compare=False)


_IO_ROLES = (Role.IN, Role.OUT)


def transfer(reference: Program, target: Target, strategy: Strategy, *, name: str | None = None) -> Program:
    """The reference with the target's variant slots, params and KV-loop strategy."""
    # the spec's aux tensors and scalars keep their names; a reference tile or scalar of one of those names is renamed
    claimed = {a.name for a in target.aux} | {d for a in target.aux for d in a.shape if isinstance(d, str)}
    reference = keep_apart(reference, claimed | set(target.scalars) - {"sm_scale"})
    params = _params_for(reference, target)
    # the head dim is the spec's, padded at launch to a power of two: a reference padded for
    # D=128 would make a D=64 kernel do twice the work
    schedule = replace(reference.schedule, head_pad=0)
    if target.block_m or target.block_n:
        schedule = replace(schedule, block_m=target.block_m or schedule.block_m, block_n=target.block_n or schedule.block_n)
    kernels = tuple(_rewrite_kernel(k, target, strategy) for k in reference.kernels)
    program = Program(
        name=name or f"{reference.name}__{strategy.value}",
        params=params,
        schedule=schedule,
        kernels=kernels,
        score_mod=VariantFn("score_mod", SCORE_MOD_PARAMS, target.score_mod) if target.score_mod is not None else None,
        mask_mod=VariantFn("mask_mod", MASK_MOD_PARAMS, target.mask_mod) if target.mask_mod is not None else None,
    )
    return with_value_dim(program) if target.value_dim else without_value_dim(program)


def _params_for(reference: Program, target: Target) -> tuple[Param, ...]:
    kept = []
    for p in reference.params:
        if p.role is Role.AUX:
            continue  # the reference's aux tensors belong to its own variant
        if p.role is Role.SCALAR and p.name != "sm_scale":
            continue
        if p.role in _IO_ROLES and p.dtype in (Dtype.F32, Dtype.BF16, Dtype.F16) and p.name != "lse":
            out_dtype = target.out_dtype if p.role is Role.OUT else None
            p = replace(p, dtype=out_dtype if out_dtype is not None else target.dtype)
        kept.append(p)
    names = {p.name for p in kept}
    extra = [Param(s, (), Dtype.F32, Role.SCALAR) for s in target.scalars if s not in names]
    extra += [a for a in target.aux if a.name not in names]
    return tuple(kept) + tuple(extra)


def _kv_loops(body: tuple[Stmt, ...]) -> list[For]:
    """The KV loops: the Fors whose bodies hold the online softmax update (the AMD Triton kernel has two: its
    full blocks, then the padded last one)."""
    return [st for st in body if isinstance(st, For) and any(isinstance(s, OnlineSoftmax) for s in walk_stmts(st.body))]


def _q_start(body: tuple[Stmt, ...]) -> Expr:
    for st in walk_stmts(body):
        if isinstance(st, Load) and st.tensor == "q":
            for ix in st.index:
                if isinstance(ix, Span):
                    return ix.start
    raise KBError("reference program has no `load ... = q[..., start:+BLOCK_M, ...]`: cannot find its query block")


def _adapt_heads(kernel: Kernel) -> Kernel:
    """GQA/MQA head mapping: k/v head = h // (Hq // Hkv) wherever the reference used the query head.

    Identity for MHA (Hq == Hkv), so it is always applied; a reference already mapping heads
    (a let or index other than plain `h`) is left alone.
    """
    head_axis = kernel.grid[1].name if len(kernel.grid) > 1 else "h"
    mapped = parse_expr(f"{head_axis} // (Hq // Hkv)")
    plain = var(head_axis)
    aliases = {st.name for st in kernel.body if isinstance(st, Let) and st.value == plain}

    def fix_index(ix: tuple) -> tuple:
        if len(ix) > 1 and isinstance(ix[1], Expr) and (ix[1] == plain or (ix[1].op is ExprOp.VAR and ix[1].value in aliases)):
            return (ix[0], mapped, *ix[2:])
        return ix

    def fix(st: Stmt) -> Stmt:
        return replace(st, index=fix_index(st.index)) if isinstance(st, Load) and st.tensor in ("k", "v") else st

    return replace(kernel, body=map_stmts(kernel.body, fix))


def _rewrite_kernel(kernel: Kernel, target: Target, strategy: Strategy) -> Kernel:
    """Every KV loop gets the target's variant application. The first also gets the strategy's bounds; when
    those are the whole KV range or the mask's band (DERIVE, BLOCK_MASK outside a split), it covers what the
    reference's later KV loops did (a padded last block), so they go: kept, they would count those keys twice."""
    kernel = _adapt_heads(kernel)
    loops = _kv_loops(kernel.body)
    if not loops:
        return kernel  # e.g. a split-KV combine kernel: nothing variant-specific
    q_start = _q_start(kernel.body)
    split = _split_axes(kernel)
    covers_all = strategy is not Strategy.REUSE and not (split & (free_vars(loops[0].lo) | free_vars(loops[0].hi)))
    new: dict[int, For | None] = {}
    for i, loop in enumerate(loops):
        kept = _block_tests(loop.body) if strategy is Strategy.REUSE else frozenset()
        inner = rewrite_loop_body(loop.body, target, strategy, _mask_at(loop, q_start), kept)
        lo, hi = _bounds(loop, target, strategy, q_start, split) if i == 0 else (loop.lo, loop.hi)
        new[id(loop)] = None if i > 0 and covers_all else replace(loop, lo=lo, hi=hi, body=inner)
    body = tuple(new.get(id(st), st) for st in kernel.body)
    return replace(kernel, body=tuple(st for st in body if st is not None))


def _mask_at(loop: For, q_start: Expr) -> TileAt:
    for st in walk_stmts(loop.body):
        if isinstance(st, (Mask, ScoreMod, IfBlock)):
            return st.at
    return TileAt(var("b"), var("h"), q_start, var(loop.var))


def _block_tests(body: tuple[Stmt, ...]) -> frozenset[BlockClass]:
    """The block classes a loop body tests (`if block is not empty`, `is not full`)."""
    return frozenset(st.cls for st in walk_stmts(body) if isinstance(st, IfBlock))


def rewrite_loop_body(body: tuple[Stmt, ...], target: Target, strategy: Strategy, at: TileAt,
                      kept: frozenset[BlockClass] = frozenset()) -> tuple[Stmt, ...]:
    """The KV loop body with the target's score_mod after its scale step and its masking before the softmax update.
    `kept`: the reference's block tests that REUSE keeps (around the body and the mask, as BLOCK_MASK places them);
    dropped, a block-class reference's full KV range ran every tile masked (prefix-LM: 2.7x slower, run 20)."""
    out: list[Stmt] = []
    scale_done = False
    for st in _strip(body):
        if isinstance(st, OnlineSoftmax):
            out += _masking(target, strategy, at, st.scores, BlockClass.FULL in kept)
        out.append(st)
        if isinstance(st, Elementwise) and not scale_done and any(isinstance(s, Dot) for s in out):
            scale_done = True
            if target.score_mod is not None:
                out.append(ScoreMod(st.out, at))
    if target.score_mod is not None and not scale_done:
        raise KBError("reference KV loop has no scale step after its QK^T dot: cannot place score_mod")
    if target.mask_mod is not None and (strategy is Strategy.BLOCK_MASK or BlockClass.EMPTY in kept):
        return (IfBlock(BlockClass.EMPTY, True, at, then=tuple(out)),)
    return tuple(out)


def _strip(body: tuple[Stmt, ...]) -> tuple[Stmt, ...]:
    """The tile body without variant statements and block tests, flattened."""
    return without_tests(body, (ScoreMod, Mask))


def _masking(target: Target, strategy: Strategy, at: TileAt, scores: str, full_test: bool = False) -> list[Stmt]:
    if target.mask_mod is None:
        return [Mask(scores, at, use_mask_mod=False)]
    mask = Mask(scores, at, use_mask_mod=True)
    if strategy is Strategy.REUSE and not full_test:
        return [mask]
    return [IfBlock(BlockClass.FULL, True, at, then=(mask,))]


def _bounds(loop: For, target: Target, strategy: Strategy, q_start: Expr, split_axes: frozenset[str]) -> tuple[Expr, Expr]:
    if strategy is Strategy.REUSE:
        return loop.lo, loop.hi
    split = bool(split_axes & (free_vars(loop.lo) | free_vars(loop.hi)))
    lo, hi = (loop.lo, loop.hi) if split else (const(0), var("N"))
    if target.mask_mod is not None:
        bounds = band_bounds(target.mask_mod, target.dims)
        if bounds is not None:
            mlo, mhi = (substitute(e, {"m_start": q_start}) for e in bounds)
            step = var(loop.step) if isinstance(loop.step, str) else const(loop.step)
            if mlo != const(0):  # align to KV blocks, never below 0
                mlo = call("maximum", const(0), mlo // step * step)
            lo = mlo if not split else call("maximum", lo, mlo)
            hi = call("minimum", hi, mhi)
    return lo, hi


def band_bounds(mask: Expr, dims: tuple[int, int] | None) -> tuple[Expr, Expr] | None:
    """KV bounds implied by the load-free `&` terms of the mask (exact: keys outside them are masked).

    `doc[b, q_idx] == doc[b, kv_idx] & (kv_idx <= q_idx)` keeps the causal bound of its second term;
    data-dependent terms are left to runtime block classes."""
    from kb.ir.classify import mask_kv_bounds  # noqa: PLC0415  classification imports torch

    static = [t for t in conjuncts(mask) if not loaded_tensors(t)]
    if not static:
        return None
    band = static[0]
    for t in static[1:]:
        band = band & t

    return mask_kv_bounds(band, dims)


def _split_axes(kernel: Kernel) -> frozenset[str]:
    """Grid axes that enumerate KV splits (their extent mentions NUM_SPLITS)."""
    return frozenset(ax.name for ax in kernel.grid if "NUM_SPLITS" in free_vars(ax.extent))
