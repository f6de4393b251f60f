"""Variant functions on one tile, and block classes, for the reference interpreter.

`score_mod` / `mask_mod` are evaluated on a (rows x cols) tile at (q_start, kv_start) with
q_idx = q_start + arange(rows)[:, None] and kv_idx = kv_start + arange(cols)[None, :].

Out-of-range lanes (q_idx >= M from a ragged last query block, kv_idx >= N from a ragged last
KV block) are evaluated too, because a tile is computed whole. Their aux-tensor loads are
clamped into range so they cannot crash; that is sound because such kv lanes are always
masked (`mask` masks kv_idx >= N) and such q rows are never stored. A load that is out of
range for an *in-range* lane is a program error and raises `KBError` (the dense torch
reference would fail on it too).
"""

from __future__ import annotations

from typing import Mapping

import torch

from kb.errors import KBError
from kb.ir.evaluate import Value, eval_expr
from kb.ir.expr import Expr
from kb.ir.nodes import BlockClass, VariantFn

__all__ = ["UNBOUNDED", "TileCoords", "ClampedAux", "eval_variant", "eval_over_tile", "mask_tile", "classify_block"]


UNBOUNDED = 1 << 62  # the extent of a missing M or N dim (token-major and paged programs)


class TileCoords:
    """Index grids of one tile: q_idx [rows, 1], kv_idx [1, cols], and which lanes are in range. With `heads`
    (h0, H): the rows are the query heads h0, h0 + 1, ... of the one query position q_start (TileAt.head_rows);
    `h` is then the [rows, 1] head grid, and rows at heads >= H are out of range."""

    def __init__(self, q_start: int, kv_start: int, rows: int, cols: int, M: int, N: int,
                 heads: tuple[int, int] | None = None) -> None:
        step = torch.zeros(rows, dtype=torch.long) if heads is not None else torch.arange(rows)
        self.q_idx = (q_start + step).view(rows, 1)
        self.kv_idx = (kv_start + torch.arange(cols)).view(1, cols)
        self.in_range = (self.q_idx >= 0) & (self.q_idx < M) & (self.kv_idx >= 0) & (self.kv_idx < N)
        self.h: torch.Tensor | None = None
        if heads is not None:
            self.h = (heads[0] + torch.arange(rows)).view(rows, 1)
            self.in_range = self.in_range & (self.h < heads[1])
        self.shape = (rows, cols)


class ClampedAux:
    """An aux tensor whose loads clamp indices, failing only when an in-range lane is out of range."""

    def __init__(self, name: str, t: torch.Tensor, in_range: torch.Tensor,
                 reader: str = "variant function", lane: str = "an in-range (q_idx, kv_idx) pair") -> None:
        self.name, self.t, self.in_range = name, t, in_range
        self.reader, self.lane = reader, lane

    def dim(self) -> int:
        return self.t.dim()

    def __getitem__(self, idx: tuple[torch.Tensor, ...]) -> torch.Tensor:
        oob = torch.zeros((), dtype=torch.bool)
        clamped = []
        for i, n in zip(idx, self.t.shape):
            oob = oob | (i < 0) | (i >= n)
            clamped.append(i.clamp(0, max(n - 1, 0)))
        try:
            bad = oob & self.in_range
        except RuntimeError:  # index not laid out over the tile: no lane to blame, be strict
            bad = oob
        if bool(bad.any()):
            raise KBError(f"{self.reader} reads {self.name} out of range (shape {list(self.t.shape)}) "
                          f"for {self.lane}; fix the index or the aux tensor's shape")
        return self.t[tuple(clamped)]


def eval_over_tile(
    e: Expr,
    coords: TileCoords,
    env: Mapping[str, Value],
    aux: Mapping[str, torch.Tensor],
    b: int,
    h: int,
    score: torch.Tensor | None = None,
) -> torch.Tensor:
    """An expression over the variant names (score, b, h, q_idx, kv_idx) on the tile, broadcast to its shape."""
    local = {**env, "b": b, "h": h if coords.h is None else coords.h, "q_idx": coords.q_idx, "kv_idx": coords.kv_idx}
    if score is not None:
        local["score"] = score
    tensors = {name: ClampedAux(name, t, coords.in_range) for name, t in aux.items()}
    out = eval_expr(e, local, tensors)
    return torch.as_tensor(out).expand(coords.shape)


def eval_variant(
    fn: VariantFn,
    coords: TileCoords,
    env: Mapping[str, Value],
    aux: Mapping[str, torch.Tensor],
    b: int,
    h: int,
    score: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fn` over the tile, broadcast to `coords.shape` (scores keep `score`'s dtype)."""
    out = eval_over_tile(fn.body, coords, env, aux, b, h, score)
    if score is not None:
        return out.to(score.dtype).expand(coords.shape)
    return out.bool().expand(coords.shape)


def mask_tile(
    mask_mod: VariantFn | None,
    coords: TileCoords,
    env: Mapping[str, Value],
    aux: Mapping[str, torch.Tensor],
    b: int,
    h: int,
    N: int | None,
) -> torch.Tensor:
    """Allowed pairs of the tile: kv_idx < N (when the program has a dim N), and `mask_mod` when given."""
    allowed = (coords.kv_idx < (N if N is not None else UNBOUNDED)).expand(coords.shape)
    if mask_mod is not None:
        allowed = allowed & eval_variant(mask_mod, coords, env, aux, b, h)
    return allowed


def classify_block(
    mask_mod: VariantFn | None,
    env: Mapping[str, Value],
    aux: Mapping[str, torch.Tensor],
    b: int,
    h: int,
    q_start: int,
    kv_start: int,
    block_m: int,
    block_n: int,
    M: int,
    N: int,
) -> BlockClass:
    """full: every in-range pair attends and kv is not ragged; empty: none does; partial otherwise."""
    rows = max(0, min(q_start + block_m, M) - max(q_start, 0))
    cols = max(0, min(kv_start + block_n, N) - max(kv_start, 0))
    if rows == 0 or cols == 0:
        return BlockClass.EMPTY
    coords = TileCoords(max(q_start, 0), max(kv_start, 0), rows, cols, M, N)
    allowed = torch.ones(coords.shape, dtype=torch.bool)
    if mask_mod is not None:
        allowed = eval_variant(mask_mod, coords, env, aux, b, h)
    if not bool(allowed.any()):
        return BlockClass.EMPTY
    ragged = kv_start < 0 or kv_start + block_n > N or q_start < 0
    return BlockClass.FULL if bool(allowed.all()) and not ragged else BlockClass.PARTIAL
