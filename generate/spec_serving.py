"""Serving specs: paged-KV decode and packed varlen prefill, read as the dense attention they compute.

A serving spec's forward does not take q, k, v as [B, H, S, D] (docs/specs.md, "Serving specs"):
- paged decode: `forward(q, k_cache, v_cache, block_table, seq_lens)`, q [B, Hq, D], caches
  [NUM_PAGES, PAGE, Hkv, D] gathered as `k_cache[block_table]` (or a token pool [POOL, Hkv, D]
  gathered by `req_to_token` [B, MAX_CTX]), keys at or past `seq_lens[b]` masked;
- packed varlen: `forward(q, k, v, cu_seqlens)`, q, k, v [T, H, D], one attention over the packed
  tokens with a block-diagonal mask from document ids `searchsorted(cu_seqlens, arange(T), right=True)`;
  vLLM's `forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen)` masks `ids_q[q_idx] == ids_k[kv_idx]`
  with ids of each offsets tensor (the queries' and the keys' own);
- chunked prefill: packed new tokens q [Tq, Hq, D] (offsets `query_start_loc`) against a paged cache gathered
  per token, `k_cache[block_table].flatten(1, 2)[seq]` with `seq = searchsorted(query_start_loc, arange(Tq),
  right=True) - 1`: dense view [B, Hq, max chunk, D] queries (row i of sequence b is token query_start_loc[b] + i;
  rows past a sequence's chunk are padding, NaN in the reference) over MAX_PAGES * PAGE keys.

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

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Mapping

import torch

from kb.errors import KBError
from kb.ir.algebra import conjunction, conjuncts, simplify
from kb.ir.evaluate import dense_scores_mask
from kb.ir.expr import Expr, ExprOp, const, substitute, var

__all__ = ["ServingLayout", "ServingReference", "layout_of", "length_input", "dense_shapes", "serving_reference", "dense_output", "feature_mask",
           "one_sequence", "visible_keys"]

LayoutKind = Literal["paged", "pool", "varlen", "chunked"]

@dataclass(frozen=True)
class ServingLayout:
    """How a serving spec's inputs hold q, k, v (input names as in Model.forward)."""

    kind: LayoutKind
    q: str
    k: str  # the cache / pool (paged, pool) or packed keys (varlen)
    v: str
    table: str  # block_table / req_to_token (paged, pool, chunked), cu_seqlens (varlen: the queries')
    lengths: str | None  # the input bounding each sequence's keys (`kv_idx < seq_lens[b]`), if the spec masks by one
    table_k: str | None = None  # varlen: the keys' own offsets (cu_seqlens_k) when they are not the queries'
    q_offsets: str | None = None  # chunked: the packed queries' offsets (query_start_loc [B + 1])

    @property
    def chunk_offsets(self) -> str:
        """q_offsets of a chunked layout, the one kind that packs its queries."""
        if self.q_offsets is None:
            raise ValueError(f"a {self.kind} layout has no query offsets")
        return self.q_offsets

    @property
    def describe(self) -> str:
        return {"paged": "paged-KV", "pool": "paged-KV (token pool)", "varlen": "packed varlen",
                "chunked": "chunked-prefill (paged-KV)"}[self.kind]


def length_input(term: Expr) -> str | None:
    """`kv_idx < L[b]` (or `L[b] > kv_idx`, `kv_idx <= L[b] - 1`, `L[b] - 1 >= kv_idx`): the input L bounding each
    sequence's keys."""
    if term.op not in (ExprOp.LT, ExprOp.GT, ExprOp.LE, ExprOp.GE):
        return None
    a, b = term.args if term.op in (ExprOp.LT, ExprOp.LE) else term.args[::-1]
    if term.op in (ExprOp.LE, ExprOp.GE):  # kv_idx <= L[b] - 1
        if not (b.op is ExprOp.SUB and b.args[1] == const(1)):
            return None
        b = b.args[0]
    if a == var("kv_idx") and b.op is ExprOp.LOAD and b.args == (var("b"),):
        return str(b.value)
    return None


def _same_document(term: Expr, ids: set[str]) -> tuple[str, str] | None:
    """`ids_q[q_idx] == ids_k[kv_idx]` over document ids derived from offsets (one cu_seqlens, or the queries' and
    the keys' own): (ids_q, ids_k), else None."""
    if term.op is not ExprOp.EQ:
        return None
    x, y = term.args
    if y.args == (var("q_idx"),):
        x, y = y, x
    if x.op is ExprOp.LOAD and y.op is ExprOp.LOAD and {str(x.value), str(y.value)} <= ids \
            and (x.args, y.args) == ((var("q_idx"),), (var("kv_idx"),)):
        return str(x.value), str(y.value)
    return None


def _is_bound(term: Expr, layout: ServingLayout, ids: set[str]) -> bool:
    if layout.kind == "varlen":
        return _same_document(term, ids) is not None
    return layout.lengths is not None and length_input(term) == layout.lengths


def layout_of(traced: Any, inputs: Mapping[str, Any], path: Path) -> ServingLayout | None:
    """The serving layout a trace found (None: a dense spec); KBError when it is half of one."""
    if traced.gathers and traced.token_seq is not None:
        return _chunked_layout(traced, inputs, path)
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
    terms = conjuncts(traced.mask_mod) if traced.mask_mod is not None else []
    lengths = {name for name in map(length_input, terms) if name is not None}
    return ServingLayout("paged" if pages else "pool", traced.q, traced.k, traced.v,
                         gathers[traced.k], min(lengths) if lengths else None)


def _chunked_layout(traced: Any, inputs: Mapping[str, Any], path: Path) -> ServingLayout:
    """Packed query tokens against the paged cache gathered per token (see module docstring)."""
    if inputs[traced.k].dim() != 4:
        raise KBError(f"{path}: chunked prefill reads a paged cache [NUM_PAGES, PAGE, Hkv, D] "
                      f"({traced.k}[block_table].flatten(1, 2)[seq]); a token pool gathered per query token is not supported")
    layout = replace(_paged_layout(traced, True, path), kind="chunked", q_offsets=traced.token_seq[1])
    offsets, table, q = inputs[layout.chunk_offsets], inputs[layout.table], inputs[layout.q]
    if offsets.dim() != 1 or offsets.numel() != table.shape[0] + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != q.shape[0]:
        raise KBError(f"{path}: {layout.q_offsets} must hold the offsets of {layout.table}'s {table.shape[0]} sequences' "
                      f"tokens in {layout.q}, [0, ..., {q.shape[0]}]")
    return layout


def _varlen_layout(traced: Any, path: Path) -> ServingLayout:
    if set(traced.packed) != {traced.q, traced.k, traced.v}:
        raise KBError(f"{path}: q, k and v must all be packed tokens [T, H, D] read as x.transpose(0, 1).unsqueeze(0) "
                      f"(packed: {', '.join(sorted(traced.packed))})")
    ids = {name for name, (_, right) in traced.derived.items() if right}
    doc = [t for t in conjuncts(traced.mask_mod)] if traced.mask_mod is not None else []
    same = {pair for t in doc if (pair := _same_document(t, ids)) is not None}
    if len(same) != 1:
        raise KBError(f"{path}: packed [T, H, D] tokens without a block-diagonal mask from cu_seqlens; mask with "
                      "ids = torch.searchsorted(cu_seqlens, torch.arange(T), right=True), ids[:, None] == ids[None, :] "
                      "(or ids_q[:, None] == ids_k[None, :] from cu_seqlens_q and cu_seqlens_k)")
    ((ids_q, ids_k),) = same
    table, table_k = traced.derived[ids_q][0], traced.derived[ids_k][0]
    return ServingLayout("varlen", traced.q, traced.k, traced.v, table, None, None if table_k == table else table_k)


def feature_mask(mask: Expr | None, layout: ServingLayout, derived: Mapping[str, Any],
                 lengths: tuple[int, int] | None = None) -> Expr | None:
    """`mask` without the sequence's own bound (for classification only; the spec keeps it), read for one sequence
    of M queries and N keys (`one_sequence`) when `lengths` = (M, N) are given."""
    if mask is None:
        return None
    rest = conjunction([t for t in conjuncts(mask) if not _is_bound(t, layout, set(derived))])
    return rest if rest is None or lengths is None else one_sequence(rest, layout, derived, *lengths)


def one_sequence(e: Expr, layout: ServingLayout, derived: Mapping[str, Any], M: int, N: int) -> Expr:
    """`e` as it reads for one sequence filling the dense view, for classification: its N keys all valid
    (lengths[b] = N), its M queries the last M positions (bottom-right), i.e. offsets [0, M] for the queries and
    [0, N] for the keys, right sequence ids 1. So `kv_idx <= seq_lens[b] - 1` reads `kv_idx <= N - 1`, a
    bottom-right causal term of decode, and a varlen mask in sequence-local positions a causal one."""
    ends = {layout.q_offsets: M} if layout.kind == "chunked" else \
        {layout.table: M, layout.table_k or layout.table: N} if layout.kind == "varlen" else {}
    ones = {name for name, (src, right) in derived.items() if right and src in ends}
    b = var("b")

    def read(n: Expr) -> Expr:
        n = Expr(n.op, tuple(read(a) for a in n.args), n.value) if n.args else n
        if n.op is not ExprOp.LOAD:
            return n
        if n.value == layout.lengths and n.args == (b,):
            return const(N)
        if n.value in ones:
            return const(1)
        if n.value in ends and len(n.args) == 1:
            at = simplify(substitute(n.args[0], {"b": const(0)}))
            if at in (const(0), const(1)):
                return const(0 if at == const(0) else ends[str(n.value)])
        return n

    return simplify(read(e))


def dense_shapes(layout: ServingLayout, inputs: Mapping[str, torch.Tensor]) -> tuple[int, int, int, int, int, int, int]:
    """(B, Hq, Hkv, M, N, D, Dv) of the dense view of the spec's inputs."""
    q, k, v = inputs[layout.q], inputs[layout.k], inputs[layout.v]
    if layout.kind == "varlen":
        T, Hq, D = q.shape
        return 1, Hq, k.shape[1], T, k.shape[0], D, v.shape[-1]
    table = inputs[layout.table]
    per_row = k.shape[1] if layout.kind != "pool" else 1
    if layout.kind == "chunked":
        chunks = inputs[layout.chunk_offsets].diff()
        return table.shape[0], q.shape[1], k.shape[-2], int(chunks.max()) if chunks.numel() else 0, \
            table.shape[1] * per_row, q.shape[2], v.shape[-1]
    B, Hq, D = q.shape
    return B, Hq, k.shape[-2], 1, table.shape[1] * per_row, D, v.shape[-1]


class ServingReference:
    """reference(q, k, v) on the dense view: the Model on its own inputs holding q, k, v (see module docstring);
    `args(q, k, v)` are those inputs by forward name, what a kernel over the spec's own layout is run on."""

    def __init__(self, model: torch.nn.Module, inputs: list[Any], names: list[str], layout: ServingLayout,
                 visible: torch.Tensor | None = None) -> None:
        self.model, self.inputs, self.names, self.layout = model, inputs, names, layout
        self.visible = visible  # [B, N] the keys some query of each sequence attends (None: all below its length)

    def args(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
        layout, named = self.layout, dict(zip(self.names, self.inputs))
        if layout.kind == "varlen":
            named[layout.q], named[layout.k], named[layout.v] = (x[0].transpose(0, 1) for x in (q, k, v))
            return named
        named[layout.q] = _packed_queries(named, layout, q) if layout.kind == "chunked" else q[:, :, 0]
        named[layout.k] = _paged(named, layout, layout.k, k, self.visible)
        named[layout.v] = _paged(named, layout, layout.v, v, self.visible)
        return named

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        args = self.args(q, k, v)
        with torch.no_grad():
            out = self.model(*(args[n] for n in self.names))
        return dense_output(out, self.layout, args)


def serving_reference(model: torch.nn.Module, inputs: list[Any], names: list[str], layout: ServingLayout,
                      path: Path, visible: torch.Tensor | None = None) -> ServingReference:
    """The spec's reference on the dense view (ServingReference); KBError when its page table is not one.
    `visible` ([B, N], `visible_keys`): the keys whose cache slots must hold the dense view's k and v."""
    if layout.kind != "varlen":
        _check_pages(dict(zip(names, inputs)), layout, path, visible)
    return ServingReference(model, inputs, names, layout, visible)


def visible_keys(layout: ServingLayout, named: Mapping[str, torch.Tensor], mask: Expr | None,
                 aux: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[B, N] bool: the dense keys some query (of the sequence's own rows) attends under `mask`, the traced mask_mod.
    Only these are read: a page one sequence shares with another (prefix caching) outside its window is no clash."""
    B, Hq, Hkv, M, N, D, _ = dense_shapes(layout, named)
    if mask is None:
        return _valid_keys(named, layout)
    env = {"B": B, "Hq": Hq, "H": Hq, "Hkv": Hkv, "M": M, "N": N, "D": D}
    _, keep = dense_scores_mask(torch.zeros(B, Hq, M, N), None, mask, env, aux)
    keep = keep.expand(B, Hq, M, N)
    if layout.kind == "chunked":  # rows past a sequence's chunk are padding
        keep = keep & (torch.arange(M)[None, :] < named[layout.chunk_offsets].diff()[:, None])[:, None, :, None]
    return keep.any(dim=2).any(dim=1) & _valid_keys(named, layout)


def _valid_keys(named: Mapping[str, torch.Tensor], layout: ServingLayout,
                visible: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N] bool: the keys each sequence reads (`visible`, else all below its length, all when the spec bounds none)."""
    if visible is not None:
        return visible
    B, _, _, _, N, _, _ = dense_shapes(layout, named)
    n = torch.arange(N)[None, :].expand(B, N)
    if layout.lengths is None:
        return torch.ones(B, N, dtype=torch.bool)
    return n < named[layout.lengths].reshape(B, 1).long()


def _packed_queries(named: Mapping[str, torch.Tensor], layout: ServingLayout, q: torch.Tensor) -> torch.Tensor:
    """Dense queries [B, Hq, M, D] packed as the spec's q [Tq, Hq, D]: token t of sequence b is row t - offsets[b]."""
    seq, row = _token_rows(named, layout)
    return q[seq, :, row].to(named[layout.q].dtype)


def _token_rows(named: Mapping[str, torch.Tensor], layout: ServingLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, row in its chunk) of each packed query token."""
    offsets = named[layout.chunk_offsets].long()
    t = torch.arange(named[layout.q].shape[0])
    seq = torch.searchsorted(offsets, t, right=True) - 1
    return seq, t - offsets[seq]


def _slots(named: Mapping[str, torch.Tensor], layout: ServingLayout) -> torch.Tensor:
    """[B, N] long: the cache row (pool token, or page * PAGE + slot) each dense key is read from."""
    table = named[layout.table].long()
    if layout.kind == "pool":
        return table
    page = named[layout.k].shape[1]
    n = torch.arange(table.shape[1] * page)
    return table[:, n // page] * page + n % page


def _check_pages(named: Mapping[str, torch.Tensor], layout: ServingLayout, path: Path,
                 visible: torch.Tensor | None = None) -> None:
    slots = _slots(named, layout)[_valid_keys(named, layout, visible)]
    if slots.unique().numel() != slots.numel():
        raise KBError(f"{path}: {layout.table} maps two valid keys to one cache slot; a page table lists each page once")


def _paged(named: Mapping[str, torch.Tensor], layout: ServingLayout, name: str, x: torch.Tensor,
           visible: torch.Tensor | None = None) -> torch.Tensor:
    """The spec's cache `name` with dense x [B, Hkv, N, D] written at the slots of its valid keys."""
    cache = named[name].clone()
    flat = cache.reshape(-1, *cache.shape[-2:])  # [rows, Hkv, D], a view of cache
    valid = _valid_keys(named, layout, visible)
    flat[_slots(named, layout)[valid]] = x.transpose(1, 2)[valid].to(cache.dtype)
    return cache


def dense_output(out: torch.Tensor, layout: ServingLayout, named: Mapping[str, Any] | None = None) -> torch.Tensor:
    """The spec's output ([B, Hq, Dv] or [T, Hq, Dv]) as [B, Hq, M, Dv]; chunked prefill needs the spec's inputs
    `named` (its offsets), and leaves rows past a sequence's chunk NaN (the spec computes none there)."""
    if layout.kind == "chunked":
        if named is None:
            raise KBError("the dense output of a chunked-prefill spec needs its query offsets")
        B, Hq, _, M, _, _, Dv = dense_shapes(layout, named)
        dense = torch.full((B, Hq, M, Dv), float("nan"), dtype=out.dtype)
        seq, row = _token_rows(named, layout)
        dense[seq, :, row] = out
        return dense
    if layout.kind == "varlen":
        return out.transpose(0, 1).unsqueeze(0) if out.dim() == 3 else out
    return out.unsqueeze(2) if out.dim() == 3 else out
