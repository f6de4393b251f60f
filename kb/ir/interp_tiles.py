"""Tile gathers and scatters for the reference interpreter: `load` and `store` index semantics.

An index item per tensor dim:
- an `Expr` (a scalar index): the dim is dropped from the tile;
- `Span(start, size, until)`: `size` elements from `start`, in range only below `until` when given;
- `Gather(var, size, index, valid)`: `size` lanes at the tensor indices `lanes(item)` gives (with
  each lane's `valid`), computed by the caller, which owns expression evaluation;
- `Full()`: the whole dim, padded to HEAD_PAD when the dim is named `D`, to HEAD_PAD_V when it
  is named `Dv`, else to the next power of two >= its extent.

Invariants: a load reads `other` at every out-of-range position (either bound, any dim); a
store writes exactly the in-range positions and nothing else, cast to the tensor's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from kb.errors import KBError
from kb.ir.algebra import next_pow2
from kb.ir.expr import Expr
from kb.ir.nodes import Dim, Dtype, Full, Gather, Index, Span, VALUE_DIM

__all__ = ["TORCH_DTYPES", "resolve_dim", "TileIndex", "tile_index", "gather", "scatter", "scatter_add"]

TORCH_DTYPES: dict[Dtype, torch.dtype] = {
    Dtype.F32: torch.float32,
    Dtype.BF16: torch.bfloat16,
    Dtype.F16: torch.float16,
    Dtype.I32: torch.int32,
    Dtype.I64: torch.int64,
    Dtype.BOOL: torch.bool,
}


_HEAD_PADS = {"D": "HEAD_PAD", VALUE_DIM: "HEAD_PAD_V"}  # head dims and the constants their `:` tiles are padded to


def resolve_dim(d: Dim, env: Mapping[str, object]) -> int:
    """An int dim, or the int bound to a dim/constant name in `env`."""
    if isinstance(d, int):
        return d
    value = env.get(d)
    if not isinstance(value, int) or isinstance(value, bool):
        raise KBError(f"size {d!r} is not a known dim or schedule constant")
    return value


@dataclass(frozen=True)
class TileIndex:
    """Per-dim element indices (broadcastable views), their validity, and the tile shape."""

    indices: tuple[torch.Tensor, ...]  # one int64 tensor per tensor dim, shaped for broadcasting
    valid: torch.Tensor  # bool, the broadcast shape of `indices`
    tile_shape: tuple[int, ...]  # shape after dropping scalar-indexed dims


def tile_index(
    shape: Sequence[int],
    dim_names: Sequence[Dim],
    index: Sequence[Index],
    env: Mapping[str, object],
    scalar: Callable[[Expr], int],
    lanes: Callable[[Gather], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> TileIndex:
    """Element positions addressed by `index` on a tensor of `shape` (dims named `dim_names`).

    `lanes(g)` gives a Gather's tensor indices and lane validity, both of shape [size]."""
    if len(index) != len(shape):
        raise KBError(f"tensor has {len(shape)} dims, indexed with {len(index)}")
    rank = len(shape)
    positions: list[torch.Tensor] = []
    lane_ok: list[torch.Tensor] = []  # extra per-axis validity (until, gather `valid`), shaped for broadcasting
    tile_shape: list[int] = []
    for axis, (item, extent, name) in enumerate(zip(index, shape, dim_names)):
        view = [1] * rank
        if isinstance(item, Span):
            size = resolve_dim(item.size, env)
            pos = scalar(item.start) + torch.arange(size)
            if item.until is not None:
                view[axis] = size
                lane_ok.append((pos < scalar(item.until)).view(view))
            tile_shape.append(size)
        elif isinstance(item, Gather):
            if lanes is None:
                raise KBError("a gathered index needs a lane evaluator")
            pos, ok = lanes(item)
            view[axis] = pos.numel()
            lane_ok.append(ok.view(view))
            tile_shape.append(pos.numel())
        elif isinstance(item, Full):
            pad = _HEAD_PADS.get(str(name))
            size = resolve_dim(pad, env) if pad else next_pow2(extent)
            if size < extent:
                raise KBError(f"{pad}={size} is smaller than {name}={extent}; set schedule head_pad >= D or 0")
            pos = torch.arange(size)
            tile_shape.append(size)
        else:
            pos = torch.tensor([scalar(item)])
        view[axis] = pos.numel()
        positions.append(pos.view(view))
    valid = torch.ones((), dtype=torch.bool)
    for pos, extent in zip(positions, shape):
        valid = valid & (pos >= 0) & (pos < extent)
    for ok in lane_ok:
        valid = valid & ok
    full_shape = torch.broadcast_shapes(*(p.shape for p in positions)) if positions else ()
    return TileIndex(tuple(positions), valid.expand(full_shape), tuple(tile_shape))


def gather(t: torch.Tensor, ix: TileIndex, other: float) -> torch.Tensor:
    """The tile at `ix`, `other` where out of range; keeps `t`'s dtype."""
    clamped = [p.clamp(0, max(n - 1, 0)) for p, n in zip(ix.indices, t.shape)]
    if t.numel() == 0:
        values = torch.zeros(ix.valid.shape, dtype=t.dtype)
    else:
        values = t[tuple(clamped)]
    if not t.is_floating_point() and not (math.isfinite(other) and other == int(other)):
        raise KBError(f"cannot pad a {t.dtype} tensor with {other}; use an integral `other`")
    fill = torch.tensor(other, dtype=t.dtype)
    return torch.where(ix.valid, values, fill).reshape(ix.tile_shape)


def scatter_add(t: torch.Tensor, ix: TileIndex, value: torch.Tensor) -> int:
    """Add the in-range part of `value` into `t` (an accumulating store); returns elements added."""
    if tuple(value.shape) != ix.tile_shape:
        raise KBError(f"stored tile has shape {tuple(value.shape)}, the index addresses {list(ix.tile_shape)}")
    where = ix.valid
    grids = tuple(p.expand(where.shape)[where] for p in ix.indices)
    t.index_put_(grids, value.reshape(where.shape)[where].to(t.dtype), accumulate=True)
    return int(where.sum())


def scatter(t: torch.Tensor, ix: TileIndex, value: torch.Tensor) -> int:
    """Write the in-range part of `value` into `t` (cast to `t.dtype`); returns elements written."""
    if tuple(value.shape) != ix.tile_shape:
        raise KBError(f"stored tile has shape {tuple(value.shape)}, the index addresses {list(ix.tile_shape)}")
    value = value.reshape(ix.valid.shape)
    where = ix.valid
    grids = [p.expand(where.shape)[where] for p in ix.indices]
    t[tuple(grids)] = value[where].to(t.dtype)
    return int(where.sum())
