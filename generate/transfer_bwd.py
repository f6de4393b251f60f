"""Backward transfer: the verified forward program's variant slots into a retrieved backward reference.

The reference (an expert backward kernel lifted into the IR) decides the code shape: its kernels,
loop order (KV-outer dK/dV, dq by accumulation or a separate pass), schedule and GQA reduction.
The forward program gives what is the spec's: score_mod, mask_mod, their aux tensors and scalars,
the dtypes. Per tile body (the loop body that recomputes P with `probs`):
- the reference's own masking (and any variant statements) is removed;
- after the score scale, the score_mod input is kept (`elementwise sm = s`), score_mod is applied to
  the copy and the mask after it (`if block is not full: mask` for a mask_mod, else the bounds);
- after `softmax_grad`: `aux_grad` for each learnable table score_mod reads (centred on the row's lse, so a
  temperature's gradient does not carry the rounding of ds's row sums times the scores), then `score_mod_grad`;
- with a mask_mod, the tile body runs only for non-empty blocks, and the loop over q blocks
  (KV-outer) or kv blocks (Q-outer) is bounded by the mask's static band, derived from the mask
  (`kb.ir.classify.mask_kv_bounds`; for KV-outer loops with the roles of q and kv swapped).
Names: the spec names its aux tensors and scalars, the reference its tiles, loop variables and scratch
buffers; a reference name the forward also uses is renamed first (`kb.ir.rename`), and each gradient param
is `d<aux>` unless that is taken by either program (`dt` is FA2's delta tile), then `d<aux>_1`, ...
Every function is `Program -> Program`; the interpreter check against autograd is the proof.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from generate.transfer import band_bounds
from kb.errors import KBError
from kb.ir.derive import aux_partials, row_centre
from kb.ir.expr import Expr, ExprOp, call, const, loaded_tensors, substitute, var
from kb.ir.nodes import (
    AuxGrad, BlockClass, Dot, Dtype, Elementwise, For, IfBlock, Kernel, Load, Mask, Param, Probs, Program, Role,
    ScoreMod, ScoreModGrad, SoftmaxGrad, Span, Stmt, TileAt, VALUE_DIM, walk_stmts,
)
from kb.ir.rename import fresh, keep_apart, names
from kb.ir.rewrite import without_tests
from kb.ir.value_dim import backward_with_value_dim

__all__ = ["BackwardTarget", "backward_target", "transfer_backward", "grad_names"]

_FLOAT = (Dtype.F32, Dtype.BF16, Dtype.F16)
_F32_BUFFERS = ("lse", "delta", "dq_acc")  # the saved lse and the f32 scratch of a backward program


@dataclass(frozen=True)
class BackwardTarget:
    """What the backward takes from the verified forward program and the spec."""

    forward: Program
    learnable: tuple[str, ...] = ()  # aux tensors read by score_mod that are nn.Parameters of the spec
    dims: tuple[int, int] | None = None  # the spec's (M, N), to classify mask constants


def grad_names(reference: Program, target: BackwardTarget) -> dict[str, str]:
    """{learnable aux: its gradient param}: `d<aux>`, or the first `d<aux>_<i>` no name of either program takes."""
    taken = set(names(reference) | names(target.forward))
    out: dict[str, str] = {}
    for a in target.learnable:
        out[a] = fresh(f"d{a}", taken)
        taken.add(out[a])
    return out


def backward_target(forward: Program, learnable_state: tuple[str, ...], dims: tuple[int, int] | None) -> BackwardTarget:
    """Learnable = aux tensors the forward's score_mod reads that the spec holds as parameters."""
    read = loaded_tensors(forward.score_mod.body) if forward.score_mod is not None else frozenset()
    return BackwardTarget(forward, tuple(a for a in learnable_state if a in read), dims)


def transfer_backward(reference: Program, target: BackwardTarget, *, name: str) -> Program:
    """The backward reference with the forward's variant slots, params, dtypes and block skipping."""
    fwd = target.forward
    if not any(isinstance(st, Probs) for k in reference.kernels for st in walk_stmts(k.body)):
        raise KBError(f"reference {reference.name} is not a backward program (no `probs` statement)")
    reference = _apart(reference, fwd)
    if VALUE_DIM in fwd.dims():  # D_v != D_qk: the reference's value tensors and dV tiles take the value width
        reference = backward_with_value_dim(reference)
    grads = grad_names(reference, target)
    grads_in = _aux_grad_kernel(reference)
    copy = fresh("sm", names(reference) | names(fwd) | set(grads.values()))  # unless the reference has its own
    kernels = tuple(_rewrite_kernel(k, _Fill(target, grads if k.name == grads_in else {}, copy)) for k in reference.kernels)
    return Program(name=name, params=_params(reference, target, grads), schedule=replace(reference.schedule, head_pad=0),
                   kernels=kernels, score_mod=fwd.score_mod, mask_mod=fwd.mask_mod)


def _apart(reference: Program, fwd: Program) -> Program:
    """The reference with its own names that the forward's aux tensors, scalars or dims also use renamed (an aux
    tensor `s` or `delta` of the spec, a tile `s` or buffer `delta` of FA2)."""
    claimed = {p.name for p in fwd.params if p.role in (Role.AUX, Role.SCALAR) and p.name != "sm_scale"} | set(fwd.dims())
    return keep_apart(reference, claimed)


def _params(reference: Program, target: BackwardTarget, grads: dict[str, str]) -> tuple[Param, ...]:
    fwd = target.forward
    dtype = fwd.param("q").dtype
    own_grads = {st.grad for k in reference.kernels for st in walk_stmts(k.body) if isinstance(st, AuxGrad)}
    kept = []
    for p in reference.params:
        if p.role is Role.AUX or (p.role is Role.SCALAR and p.name != "sm_scale") or p.name in own_grads:
            continue  # the reference's own variant inputs and their gradients
        if p.dtype in _FLOAT and p.name not in _F32_BUFFERS and p.role in (Role.IN, Role.OUT):
            # o in fp32: Δ = rowsum(dO∘O) from the rounded output is off by dO·(O_bf16 - O) where dP - Δ cancels,
            # further than an fp32-math spec's own gradient (the operator saves the forward's fp32 O for it)
            p = replace(p, dtype=Dtype.F32 if p.name == "o" else dtype)
        kept.append(p)
    have = {p.name for p in kept}
    extra = [p for p in fwd.params if p.role in (Role.AUX, Role.SCALAR) and p.name not in have]
    return tuple(kept) + tuple(extra) + tuple(Param(g, fwd.param(a).shape, Dtype.F32, Role.OUT) for a, g in grads.items())


# ---------------------------------------------------------------- kernels


@dataclass(frozen=True)
class _Fill:
    """What a kernel's tile bodies get: the target, {aux: gradient param} accumulated there, the score_mod copy's name."""

    target: BackwardTarget
    grads: dict[str, str]
    copy: str


def _rewrite_kernel(kernel: Kernel, fill: _Fill) -> Kernel:
    return replace(kernel, body=_rewrite_body(kernel.body, kernel.body, fill))


def _aux_grad_kernel(reference: Program) -> str | None:
    """The kernel that accumulates learnable tables' gradients: the KV-outer one (a loop over q blocks) when the
    reference recomputes dS in two passes (dK/dV, then dQ), so each (q, kv) pair is counted once."""
    tiled = [k for k in reference.kernels if any(isinstance(s, Probs) for s in walk_stmts(k.body))]
    kv_outer = [k for k in tiled if any(isinstance(s, For) and s.step == "BLOCK_M" and
                                        any(isinstance(x, Probs) for x in walk_stmts(s.body)) for s in walk_stmts(k.body))]
    chosen = kv_outer or tiled
    return chosen[0].name if chosen else None


def _rewrite_body(body: tuple[Stmt, ...], kernel_body: tuple[Stmt, ...], fill: _Fill) -> tuple[Stmt, ...]:
    out: list[Stmt] = []
    for st in body:
        if isinstance(st, For) and any(isinstance(s, Probs) for s in _strip(st.body)):
            out.append(_rewrite_tile_loop(st, kernel_body, fill))
        elif isinstance(st, For):
            out.append(replace(st, body=_rewrite_body(st.body, kernel_body, fill)))
        else:
            out.append(st)
    return tuple(out)


def _rewrite_tile_loop(loop: For, kernel_body: tuple[Stmt, ...], fill: _Fill) -> For:
    fwd = fill.target.forward
    flat = _strip(loop.body)
    at = _coords(flat, kernel_body)
    tile = _tile_body(flat, at, fill)
    if fwd.mask_mod is not None:
        tile = (IfBlock(BlockClass.EMPTY, True, at, then=tile),)
    lo, hi = _loop_bounds(loop, at, fwd.mask_mod.body if fwd.mask_mod else None, fill.target.dims)
    return replace(loop, lo=lo, hi=hi, body=tile)


def _strip(body: tuple[Stmt, ...]) -> tuple[Stmt, ...]:
    """The tile body without variant statements and block tests, flattened."""
    return without_tests(body, (ScoreMod, Mask, ScoreModGrad, AuxGrad))


def _coords(flat: tuple[Stmt, ...], kernel_body: tuple[Stmt, ...]) -> TileAt:
    """(b, h, q_start, kv_start) of the tile, read off its q and k loads."""
    q = next((st for st in walk_stmts(flat) if isinstance(st, Load) and st.tensor == "q"), None) or \
        next((st for st in walk_stmts(kernel_body) if isinstance(st, Load) and st.tensor == "q"), None)
    k = next((st for st in walk_stmts(kernel_body) if isinstance(st, Load) and st.tensor == "k"), None)
    if q is None or k is None:
        raise KBError("backward reference loads no q or k tile: cannot place the mask")
    q_span = next((ix for ix in q.index if isinstance(ix, Span)), None)
    k_span = next((ix for ix in k.index if isinstance(ix, Span)), None)
    if q_span is None or k_span is None or len(q.index) < 4:
        raise KBError("backward reference's q/k loads have no block span: cannot place the mask")
    b, h = q.index[0], q.index[1]
    if not isinstance(b, Expr) or not isinstance(h, Expr):
        raise KBError("backward reference's q load has no scalar batch/head index")
    return TileAt(b, h, q_span.start, k_span.start)


def _tile_body(flat: tuple[Stmt, ...], at: TileAt, fill: _Fill) -> tuple[Stmt, ...]:
    fwd = fill.target.forward
    probs = next(st for st in flat if isinstance(st, Probs))
    scores = _scaled_scores(flat)
    copy = probs.scores if probs.scores != scores else fill.copy
    out: list[Stmt] = []
    for st in flat:
        if isinstance(st, Elementwise) and st.out == copy and st.value == var(scores):
            continue  # the reference's own copy of the score_mod input: re-made below
        if isinstance(st, Probs):
            st = replace(st, scores=copy)
        out.append(st)
        if isinstance(st, Elementwise) and st.out == scores and _is_scale(st, scores):
            out.append(Elementwise(copy, var(scores)))
            if fwd.score_mod is not None:
                out.append(ScoreMod(copy, at))
            mask = Mask(copy, at, use_mask_mod=fwd.mask_mod is not None)
            out.append(IfBlock(BlockClass.FULL, True, at, then=(mask,)) if fwd.mask_mod is not None else mask)
        if isinstance(st, SoftmaxGrad):
            out += [AuxGrad(g, a, st.out, scores, at, probs.lse if _centred(fwd, a) else None) for a, g in fill.grads.items()]
            if fwd.score_mod is not None:
                out.append(ScoreModGrad(st.out, scores, at))
    return tuple(out)


def _centred(fwd: Program, aux: str) -> bool:
    """Whether some load of `aux` in score_mod has a row centre (`kb.ir.derive.row_centre`): a temperature, a bias."""
    body = fwd.score_mod.body if fwd.score_mod is not None else None
    return body is not None and any(row_centre(body, ix, g) is not None for ix, g in aux_partials(body, aux))


def _scaled_scores(flat: tuple[Stmt, ...]) -> str:
    """The score tile: the first dot's output, scaled in place by sm_scale right after it."""
    dot = next((st for st in flat if isinstance(st, Dot)), None)
    if dot is None or not any(isinstance(st, Elementwise) and st.out == dot.out and _is_scale(st, dot.out) for st in flat):
        raise KBError("backward reference's tile body has no `s = q @ trans(k)` scaled by sm_scale: cannot place score_mod")
    return dot.out


def _is_scale(st: Elementwise, scores: str) -> bool:
    return st.value.op is ExprOp.MUL and set(st.value.args) == {var(scores), var("sm_scale")}


# ---------------------------------------------------------------- loop bounds


def _loop_bounds(loop: For, at: TileAt, mask: Expr | None, dims: tuple[int, int] | None) -> tuple[Expr, Expr]:
    """[lo, hi) of the loop over q blocks (step BLOCK_M, KV-outer) or kv blocks (step BLOCK_N, Q-outer)."""
    kv_outer = loop.step == "BLOCK_M"
    full = (const(0), var("M" if kv_outer else "N"))
    if mask is None:
        return full
    if not kv_outer:
        band = band_bounds(mask, dims)
        if band is None:
            return full
        lo, hi = (substitute(e, {"m_start": at.q_start}) for e in band)
        return _aligned(lo, hi, "BLOCK_N")
    swapped = substitute(mask, {"q_idx": var("kv_idx"), "kv_idx": var("q_idx")})
    band = band_bounds(swapped, dims[::-1] if dims else None)
    if band is None:
        return full
    roles = {"m_start": at.kv_start, "BLOCK_M": var("BLOCK_N"), "M": var("N"), "N": var("M")}
    lo, hi = (substitute(e, roles) for e in band)
    return _aligned(lo, hi, "BLOCK_M")


def _aligned(lo: Expr, hi: Expr, block: str) -> tuple[Expr, Expr]:
    """`lo` rounded down to a block boundary (the loop visits whole blocks), never below 0."""
    if lo != const(0):
        if lo.op is ExprOp.MAXIMUM and lo.args[0] == const(0):
            lo = lo.args[1]  # clamped again below, after rounding
        b = var(block)
        lo = call("maximum", const(0), lo // b * b)

    return lo, hi
