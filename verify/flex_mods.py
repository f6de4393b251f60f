"""How FlexAttention runs a score_mod / mask_mod, for references and tracing: one (b, h, q_idx, kv_idx) at a time.

FlexAttention vmaps a mod over 0-dim index tensors (int32 here, as its compiled kernels pass them), with
`table[idx]` read as a gather (aten.index) rather than through `int(idx)`. So a mod may index a table by
them and keep indexing what comes out (`intervals[image_idx][0]`), reduce over a table's own dim
(`(tiles == kv_tile.unsqueeze(-1)).any(-1)`), and close over tensors built by a factory (attention-gym's
`generate_doc_mask_mod(...)` captures `document_id`). This module gives:

- `TensorIndexing`: the indexing rule above, as a torch function mode (tracing and `evaluate_mods` use it);
- `evaluate_mods(...)`: scores and the keep-mask on a [B, H, M, N] grid, vmapped over the four indices;
- `captured_tensors(...)` / `move_captured(...)`: the tensors the mods read (module globals, closure cells,
  recursively through mods that wrap mods, as `and_masks` does), by name, and moving them to a device;
- `data_bound_dims(...)`: which of B, Hq, M, N the captured data fixes: a dim is fixed when the mods cannot
  be evaluated with it one larger (an index runs past the data, `document_id[q_idx]` with q_idx = S).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["TensorIndexing", "evaluate_mods", "mod_functions", "captured_tensors", "move_captured", "data_bound_dims", "Mod", "DIMS"]

Mod = Callable[..., Any]
DIMS = ("B", "Hq", "M", "N")  # the grid a mod is evaluated on: b < B, h < Hq, q_idx < M, kv_idx < N


class TensorIndexing(TorchFunctionMode):
    """`t[i, j]` with tensor (or int) indices is `aten.index(t, [i, j])`: a gather that traces and vmaps, where
    `Tensor.__getitem__` would turn a 0-dim index tensor into a Python int."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__getitem__:
            t, idx = args[0], args[1]
            items = idx if isinstance(idx, tuple) else (idx,)
            if any(isinstance(x, torch.Tensor) for x in items) and \
                    all(isinstance(x, torch.Tensor) or isinstance(x, int) and not isinstance(x, bool) for x in items):
                return torch.ops.aten.index.Tensor(t, [x if isinstance(x, torch.Tensor) else
                                                       torch.tensor(x, device=t.device) for x in items])
        return func(*args, **(kwargs or {}))


def _vmapped(fn: Mod, score: bool) -> Mod:
    """`fn` over 1-D aranges of b, h, q_idx, kv_idx (and a [B, H, M, N] score), one element per call."""

    def one(*args: Any) -> torch.Tensor:
        return torch.as_tensor(fn(*args))

    f: Mod = one
    for k in (3, 2, 1, 0):  # kv_idx innermost, b outermost; the score peels one leading dim per level
        dims: list[int | None] = [None] * 4
        dims[k] = 0
        f = torch.vmap(f, in_dims=((0,) if score else ()) + tuple(dims))
    return f


def evaluate_mods(scores: torch.Tensor, score_mod: Mod | None, mask_mod: Mod | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(score_mod(scores), mask_mod) on the [B, H, M, N] grid of `scores`, as FlexAttention evaluates them
    (fp32 scores; the mask all True without a mask_mod)."""
    B, H, M, N = scores.shape
    dev = scores.device
    b, h, q, kv = (torch.arange(n, dtype=torch.int32, device=dev) for n in (B, H, M, N))
    with TensorIndexing():
        if score_mod is not None:
            scores = _vmapped(score_mod, True)(scores, b, h, q, kv).float().expand(B, H, M, N)
        keep = torch.ones(B, H, M, N, dtype=torch.bool, device=dev)
        if mask_mod is not None:
            keep = _vmapped(mask_mod, False)(b, h, q, kv).bool().expand(B, H, M, N)
    return scores, keep


# ---------------------------------------------------------------- the data the mods read


def mod_functions(fns: list[Any]) -> list[types.FunctionType]:
    """The functions the mods are made of: themselves and every function their closures or globals reach
    (`and_masks(sliding_window, causal_mask)` reaches both); torch's own functions are not searched further
    through their globals (F.relu's helpers hold no data of the spec)."""
    seen: dict[int, types.FunctionType] = {}
    todo = list(fns)
    while todo:
        fn = todo.pop(0)
        if id(fn) in seen or not isinstance(fn, types.FunctionType):
            continue
        seen[id(fn)] = fn
        for cell in fn.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            todo += list(value) if isinstance(value, (tuple, list)) else [value]  # and_masks(*mask_mods)
        if not _in_torch(fn):
            todo += [fn.__globals__.get(name) for name in fn.__code__.co_names]
    return list(seen.values())


def _in_torch(fn: types.FunctionType) -> bool:
    return (fn.__module__ or "").split(".")[0] == "torch"


def _tensor_slots(fns: list[Any]) -> Iterator[tuple[str, Any, str]]:
    """(name, holder, key) of every tensor the functions read: a closure cell (key "") or a globals dict."""
    for fn in mod_functions(fns):
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                if isinstance(cell.cell_contents, torch.Tensor):
                    yield name, cell, ""
            except ValueError:
                continue
        for name in () if _in_torch(fn) else fn.__code__.co_names:
            if isinstance(fn.__globals__.get(name), torch.Tensor):
                yield name, fn.__globals__, name


def captured_tensors(fns: list[Any]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each tensor the mods read, globals and closure cells alike (named as the code names them)."""
    out = []
    for name, holder, key in _tensor_slots(fns):
        out.append((name, holder[key] if key else holder.cell_contents))
    return out


def move_captured(fns: list[Any], device: torch.device) -> None:
    """Move every tensor the mods read to `device` (they index it with device index tensors there)."""
    for _, holder, key in list(_tensor_slots(fns)):
        t = holder[key] if key else holder.cell_contents
        if t.device != device:
            if key:
                holder[key] = t.to(device)
            else:
                holder.cell_contents = t.to(device)


def data_bound_dims(score_mod: Mod | None, mask_mod: Mod | None, sizes: Mapping[str, int]) -> dict[str, str]:
    """Dim name (of DIMS) -> why the mods' data fixes it at `sizes[dim]`: the error evaluating the mods with that
    dim one larger raises (an index runs past a captured tensor). Mods that read no tensor fix nothing."""
    data = captured_tensors([m for m in (score_mod, mask_mod) if m is not None])
    if not data:
        return {}
    fixed: dict[str, str] = {}
    for dim in DIMS:
        grown = [sizes[d] + (d == dim) for d in DIMS]
        try:
            evaluate_mods(torch.zeros(grown, device=data[0][1].device), score_mod, mask_mod)
        except Exception as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            fixed[dim] = first
    return fixed
