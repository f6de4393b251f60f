"""Derive the feature vector of a Program from its structure (never typed by hand).

Rules (each reads the program, optionally with concrete `shapes` B, Hq, Hkv, M, N, D):
- mask / score kinds: `kb.ir.classify` on the mask_mod / score_mod bodies (the same
  classification specs use, so both sides agree).
- gqa_ratio: Hq // Hkv from `shapes`; else from integer head dims of q and k in the params
  (a specialised program); else 1 (symbolic heads say nothing about the ratio).
- head_dim: shapes["D"]; else schedule.head_pad when set; else an integer last dim of q;
  else 0, meaning "any head dim" (a program generic in D).
- dtype: q's dtype, spelled as specs spell it ("fp32", "bf16", "fp16").
- backward: the program recomputes probabilities from a saved lse (`probs`), `kb.ir.nodes.is_backward`;
  learned_table: it also reduces a learnable aux tensor's gradient (`aux_grad`).
- split_kv: a grid axis whose extent uses NUM_SPLITS, or a `combine` statement.
- decode: split_kv with num_splits > 1, or decode-shaped `shapes` (seq_q <= 16, seq_kv >= 8 seq_q).
- return_lse: an out param named `lse` is stored.
- varlen: q is loaded at an index that itself loads a tensor (sequence offsets: a span start or
  `until`, directly or through `let`s, e.g. `q[q0 + m_start:+BLOCK_M until q0 + q_len, h, :]` with
  `let q0 = b_start_loc[b]`); paged_kv: k or v is loaded at an index that loads a tensor using a
  loop variable (a page table: a scalar index or span start, or a gathered axis's index).
- scalar params in variant bodies (`softcap * tanh(score / softcap)`, `q_idx - kv_idx < window`)
  are runtime values: the bodies are classified with two probe values substituted, and the
  result is kept when both probes agree (else the unsubstituted body decides, usually "custom");
  a band bounded by such a scalar has kv_span 0 (unknown until run time).
- cross: seq_q != seq_kv in `shapes` (and not decode); dropout: never (the IR has no dropout).
- sinks: the running max of an `online_softmax` starts at an expression (`init m_i = full(BLOCK_M; sinks[h])`),
  not at a number: an attention sink's logit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Mapping

from kb.features import Features
from kb.ir.expr import Expr, ExprOp, const, free_vars, substitute, walk
from kb.ir.nodes import (
    Combine, Dtype, For, Init, Let, Load, OnlineSoftmax, Program, Role, Stmt, Store, aux_gradients, index_exprs,
    is_backward, walk_stmts,
)

__all__ = ["derive_features", "derive", "is_split_kv", "returns_lse", "has_sinks"]


def _all_stmts(p: Program) -> Iterator[Stmt]:
    for k in p.kernels:
        yield from walk_stmts(k.body)


def _loop_vars(stmts: tuple[Stmt, ...]) -> set[str]:
    return {st.var for st in walk_stmts(stmts) if isinstance(st, For)}


def is_split_kv(p: Program) -> bool:
    """A split-KV program: a grid axis over NUM_SPLITS or an LSE combine."""
    split_axis = any("NUM_SPLITS" in free_vars(a.extent) for k in p.kernels for a in k.grid)
    return split_axis or any(isinstance(st, Combine) for st in _all_stmts(p))


def has_sinks(p: Program) -> bool:
    """An online softmax whose running max starts at an expression (an attention sink's logit), not a number."""
    maxes = {st.m for st in _all_stmts(p) if isinstance(st, OnlineSoftmax)}
    return any(isinstance(st, Init) and st.out in maxes and isinstance(st.fill, Expr) for st in _all_stmts(p))


def returns_lse(p: Program) -> bool:
    outs = {prm.name for prm in p.params if prm.role is Role.OUT}
    return "lse" in outs and any(isinstance(st, Store) and st.tensor == "lse" for st in _all_stmts(p))


def _indirect(st: Load, lets: dict[str, Expr], loop_vars: set[str] | None) -> bool:
    """The load's index reads another tensor (optionally: indexed by a loop variable), `let`s expanded."""
    for e in index_exprs(st):
        for n in walk(substitute(e, lets)):
            if n.op is ExprOp.LOAD and (loop_vars is None or free_vars(n) & loop_vars):
                return True
    return False


def _addressing(p: Program) -> tuple[bool, bool]:
    """(varlen, paged_kv) from indirect addressing of q and of k/v."""
    varlen = paged = False
    for k in p.kernels:
        loops = _loop_vars(k.body)
        lets: dict[str, Expr] = {}  # each let's value with earlier lets expanded (a rebinding replaces it)
        for st in walk_stmts(k.body):
            if isinstance(st, Let):
                lets[st.name] = substitute(st.value, lets)
            elif isinstance(st, Load):
                varlen |= st.tensor == "q" and _indirect(st, lets, None)
                paged |= st.tensor in ("k", "v") and _indirect(st, lets, loops)
    return varlen, paged


def _dim_of(p: Program, tensor: str, axis: int) -> str | int | None:
    try:
        shape = p.param(tensor).shape
    except KeyError:
        return None
    return shape[axis] if -len(shape) <= axis < len(shape) else None


def _gqa_ratio(p: Program, shapes: Mapping[str, int]) -> int:
    if "Hq" in shapes and "Hkv" in shapes:
        return max(1, int(shapes["Hq"]) // max(1, int(shapes["Hkv"])))
    hq, hkv = _dim_of(p, "q", 1), _dim_of(p, "k", 1)
    if isinstance(hq, int) and isinstance(hkv, int) and hkv > 0:
        return max(1, hq // hkv)
    return 1


def _head_dim(p: Program, shapes: Mapping[str, int]) -> int:
    if "D" in shapes:
        return int(shapes["D"])
    if p.schedule.head_pad:
        return p.schedule.head_pad
    d = _dim_of(p, "q", -1)
    return d if isinstance(d, int) else 0


# Features spell dtypes as specs do (fp32, bf16, fp16); the IR spells them f32, bf16, f16.
_FEATURE_DTYPE = {Dtype.F32: "fp32", Dtype.BF16: "bf16", Dtype.F16: "fp16"}


def _dtype(p: Program) -> str:
    try:
        dt = p.param("q").dtype
    except KeyError:
        dt = Dtype.F32
    return _FEATURE_DTYPE.get(dt, dt.value)


_PROBES = (17, 50)  # runtime scalar values tried during classification


def _with_scalars(e: Expr | None, scalars: set[str], value: int) -> Expr | None:
    if e is None:
        return None
    return substitute(e, {name: const(value) for name in free_vars(e) & scalars})


def derive_features(p: Program, *, arch: str = "any", shapes: Mapping[str, int] | None = None) -> Features:
    """The Features of `p` (see the module docstring for each rule)."""
    scalars = {prm.name for prm in p.params if prm.role is Role.SCALAR}
    score = p.score_mod.body if p.score_mod else None
    mask = p.mask_mod.body if p.mask_mod else None
    # a band set by a runtime scalar has no constant span
    probed = {replace(_classified(p, _with_scalars(score, scalars, v), _with_scalars(mask, scalars, v), arch, shapes),
                      kv_span=0) for v in _PROBES}
    if len(probed) == 1:
        return probed.pop()
    return _classified(p, score, mask, arch, shapes)


def _classified(p: Program, score: Expr | None, mask: Expr | None, arch: str,
                shapes: Mapping[str, int] | None) -> Features:
    from kb.ir.classify import features_from_variants  # noqa: PLC0415  lazy: classification imports torch

    shapes = dict(shapes or {})
    split = is_split_kv(p)
    varlen, paged = _addressing(p)
    seq_q, seq_kv = shapes.get("M"), shapes.get("N")
    feats = features_from_variants(
        score,
        mask,
        head_dim=_head_dim(p, shapes),
        dtype=_dtype(p),
        gqa_ratio=_gqa_ratio(p, shapes),
        seq_q=seq_q,
        seq_kv=seq_kv,
        return_lse=returns_lse(p),
        paged_kv=paged,
        varlen=varlen,
        split_kv=split,
        arch=arch,
        sinks=has_sinks(p),
    )
    decode = feats.decode or (split and p.schedule.num_splits > 1)
    feats = feats if decode == feats.decode else replace(feats, decode=decode, cross=False)
    return replace(feats, backward=True, learned_table=bool(aux_gradients(p))) if is_backward(p) else feats


derive = derive_features  # the name kb/features.py's docstring uses
