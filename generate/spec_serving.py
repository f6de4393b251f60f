"""Serving specs: paged-KV decode and packed varlen prefill, read as the dense attention they compute.

A serving spec's forward does not take q, k, v as [B, H, S, D] (docs/specs.md, "Serving specs"):
- paged decode: `forward(q, k_cache, v_cache, block_table, seq_lens)`, q [B, Hq, D], caches
  [NUM_PAGES, PAGE, Hkv, D] gathered as `k_cache[block_table]` (or a token pool [POOL, Hkv, D]
  gathered by `req_to_token` [B, MAX_CTX]), keys at or past `seq_lens[b]` masked;
- packed varlen: `forward(q, k, v, cu_seqlens)`, q, k, v [T, H, D], one attention over the packed
  tokens with a block-diagonal mask from document ids `searchsorted(cu_seqlens, arange(T), right=True)`.

Tracing (generate.spec_trace) reads them like any spec; this module holds what differs:
`layout_of` names the layout, `dense_shapes` gives the dense view ([B, Hq, 1, D] queries over
MAX_PAGES * PAGE keys; [1, H, T, D] packed tokens), `serving_reference` runs the user's Model on
dense q, k, v (paging or packing them into the spec's own inputs), and `feature_mask` drops the
sequence's own bound (`kv_idx < seq_lens[b]`, the same-document term of packing) before
classification, as the serving lifter does for its programs: those bounds are the layout, not a
variant mask.

Invariant: `serving_reference(...)(q, k, v)` is the user's Model on inputs holding exactly q, k, v at
the positions the spec reads (the cache slots of valid keys, the packed rows); it returns the dense
[B, Hq, M, Dv] output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import torch

from kb.errors import KBError
from kb.ir.algebra import conjunction, conjuncts
from kb.ir.expr import Expr, ExprOp, var

__all__ = ["ServingLayout", "ServingReference", "layout_of", "dense_shapes", "serving_reference", "dense_output", "feature_mask",
           "GENERATION_REFUSED"]

LayoutKind = Literal["paged", "pool", "varlen"]

GENERATION_REFUSED = ("generation for {kind} specs is not supported yet: the Triton and CUDA lowerings refuse "
                      "programs with `until` spans and gathered axes (kb/lower); `kb query SPEC` ranks references for it")


@dataclass(frozen=True)
class ServingLayout:
    """How a serving spec's inputs hold q, k, v (input names as in Model.forward)."""

    kind: LayoutKind
    q: str
    k: str  # the cache / pool (paged, pool) or packed keys (varlen)
    v: str
    table: str | None  # block_table / req_to_token (paged, pool), cu_seqlens (varlen)
    lengths: str | None  # the input bounding each sequence's keys (`kv_idx < seq_lens[b]`), if the spec masks by one

    @property
    def describe(self) -> str:
        return {"paged": "paged-KV", "pool": "paged-KV (token pool)", "varlen": "packed varlen"}[self.kind]


def _length_input(term: Expr) -> str | None:
    """`kv_idx < L[b]` (or `L[b] > kv_idx`): the input L bounding each sequence's keys."""
    a, b = term.args if term.op in (ExprOp.LT, ExprOp.GT) else (None, None)
    if term.op is ExprOp.GT:
        a, b = b, a
    if a == var("kv_idx") and b is not None and b.op is ExprOp.LOAD and b.args == (var("b"),):
        return str(b.value)
    return None


def _same_document(term: Expr, ids: set[str]) -> bool:
    """`ids[q_idx] == ids[kv_idx]` over document ids derived from cu_seqlens."""
    if term.op is not ExprOp.EQ:
        return False
    x, y = term.args
    return (x.op is ExprOp.LOAD and y.op is ExprOp.LOAD and x.value == y.value and str(x.value) in ids
            and {x.args, y.args} == {(var("q_idx"),), (var("kv_idx"),)})


def _is_bound(term: Expr, layout: ServingLayout, ids: set[str]) -> bool:
    if layout.kind == "varlen":
        return _same_document(term, ids)
    return layout.lengths is not None and _length_input(term) == layout.lengths


def layout_of(traced: Any, inputs: Mapping[str, Any], path: Path) -> ServingLayout | None:
    """The serving layout a trace found (None: a dense spec); KBError when it is half of one."""
    if traced.gathers:
        return _paged_layout(traced, inputs[traced.k].dim() == 4, path)
    if traced.packed:
        return _varlen_layout(traced, path)
    return None


def _paged_layout(traced: Any, pages: bool, path: Path) -> ServingLayout:
    gathers = dict(traced.gathers)
    if set(gathers) != {traced.k, traced.v} or len(set(gathers.values())) != 1:
        raise KBError(f"{path}: k and v must both be read through one table (got {gathers or 'none'}): "
                      f"{traced.k}[block_table] and {traced.v}[block_table]")
    lengths = {_length_input(t) for t in conjuncts(traced.mask_mod)} - {None} if traced.mask_mod is not None else set()
    return ServingLayout("paged" if pages else "pool", traced.q, traced.k, traced.v,
                         gathers[traced.k], min(lengths) if lengths else None)


def _varlen_layout(traced: Any, path: Path) -> ServingLayout:
    if set(traced.packed) != {traced.q, traced.k, traced.v}:
        raise KBError(f"{path}: q, k and v must all be packed tokens [T, H, D] read as x.transpose(0, 1).unsqueeze(0) "
                      f"(packed: {', '.join(sorted(traced.packed))})")
    ids = set(traced.derived)
    doc = [t for t in conjuncts(traced.mask_mod)] if traced.mask_mod is not None else []
    if not any(_same_document(t, ids) for t in doc):
        raise KBError(f"{path}: packed [T, H, D] tokens without a block-diagonal mask from cu_seqlens; mask with "
                      "ids = torch.searchsorted(cu_seqlens, torch.arange(T), right=True), ids[:, None] == ids[None, :]")
    (table,) = {src for src, _ in traced.derived.values()}
    return ServingLayout("varlen", traced.q, traced.k, traced.v, table, None)


def feature_mask(mask: Expr | None, layout: ServingLayout, derived: Mapping[str, Any]) -> Expr | None:
    """`mask` without the sequence's own bound (for classification only; the spec keeps it)."""
    if mask is None:
        return None
    rest = [t for t in conjuncts(mask) if not _is_bound(t, layout, set(derived))]
    return conjunction(rest)


def dense_shapes(layout: ServingLayout, inputs: Mapping[str, torch.Tensor]) -> tuple[int, int, int, int, int, int, int]:
    """(B, Hq, Hkv, M, N, D, Dv) of the dense view of the spec's inputs."""
    q, k, v = inputs[layout.q], inputs[layout.k], inputs[layout.v]
    if layout.kind == "varlen":
        T, Hq, D = q.shape
        return 1, Hq, k.shape[1], T, k.shape[0], D, v.shape[-1]
    B, Hq, D = q.shape
    table = inputs[layout.table]  # type: ignore[index]
    per_row = k.shape[1] if layout.kind == "paged" else 1
    return B, Hq, k.shape[-2], 1, table.shape[1] * per_row, D, v.shape[-1]


class ServingReference:
    """reference(q, k, v) on the dense view: the Model on its own inputs holding q, k, v (see module docstring);
    `args(q, k, v)` are those inputs by forward name, what a kernel over the spec's own layout is run on."""

    def __init__(self, model: torch.nn.Module, inputs: list[Any], names: list[str], layout: ServingLayout) -> None:
        self.model, self.inputs, self.names, self.layout = model, inputs, names, layout

    def args(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
        layout, named = self.layout, dict(zip(self.names, self.inputs))
        if layout.kind == "varlen":
            named[layout.q], named[layout.k], named[layout.v] = (x[0].transpose(0, 1) for x in (q, k, v))
        else:
            named[layout.q] = q[:, :, 0]
            named[layout.k] = _paged(named, layout, layout.k, k)
            named[layout.v] = _paged(named, layout, layout.v, v)
        return named

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        args = self.args(q, k, v)
        with torch.no_grad():
            out = self.model(*(args[n] for n in self.names))
        return dense_output(out, self.layout)


def serving_reference(model: torch.nn.Module, inputs: list[Any], names: list[str], layout: ServingLayout,
                      path: Path) -> ServingReference:
    """The spec's reference on the dense view (ServingReference); KBError when its page table is not one."""
    if layout.kind != "varlen":
        _check_pages(dict(zip(names, inputs)), layout, path)
    return ServingReference(model, inputs, names, layout)


def _valid_keys(named: Mapping[str, torch.Tensor], layout: ServingLayout) -> torch.Tensor:
    """[B, N] bool: the keys each sequence reads (all of them when the spec bounds none)."""
    B, _, _, _, N, _, _ = dense_shapes(layout, named)
    n = torch.arange(N)[None, :].expand(B, N)
    if layout.lengths is None:
        return torch.ones(B, N, dtype=torch.bool)
    return n < named[layout.lengths].reshape(B, 1).long()


def _slots(named: Mapping[str, torch.Tensor], layout: ServingLayout) -> torch.Tensor:
    """[B, N] long: the cache row (pool token, or page * PAGE + slot) each dense key is read from."""
    table = named[layout.table].long()  # type: ignore[index]
    if layout.kind == "pool":
        return table
    page = named[layout.k].shape[1]
    n = torch.arange(table.shape[1] * page)
    return table[:, n // page] * page + n % page


def _check_pages(named: Mapping[str, torch.Tensor], layout: ServingLayout, path: Path) -> None:
    slots = _slots(named, layout)[_valid_keys(named, layout)]
    if slots.unique().numel() != slots.numel():
        raise KBError(f"{path}: {layout.table} maps two valid keys to one cache slot; a page table lists each page once")


def _paged(named: Mapping[str, torch.Tensor], layout: ServingLayout, name: str, x: torch.Tensor) -> torch.Tensor:
    """The spec's cache `name` with dense x [B, Hkv, N, D] written at the slots of its valid keys."""
    cache = named[name].clone()
    flat = cache.reshape(-1, *cache.shape[-2:])  # [rows, Hkv, D], a view of cache
    valid = _valid_keys(named, layout)
    flat[_slots(named, layout)[valid]] = x.transpose(1, 2)[valid].to(cache.dtype)
    return cache


def dense_output(out: torch.Tensor, layout: ServingLayout) -> torch.Tensor:
    """The spec's output ([B, Hq, Dv] or [T, Hq, Dv]) as [B, Hq, M, Dv]."""
    if layout.kind == "varlen":
        return out.transpose(0, 1).unsqueeze(0) if out.dim() == 3 else out
    return out.unsqueeze(2) if out.dim() == 3 else out
