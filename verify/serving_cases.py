"""Serving-layout inputs a spec's own get_inputs() may not hold: pages moved and shared, ragged and empty sequences.

A paged or packed kernel that is right on the spec's own inputs can still assume what an engine never promises:
pages laid out in order, no page shared between sequences (prefix caching shares them), no empty or one-token
sequence, unused block-table entries at 0. `serving_variants` derives, from the spec's own inputs, inputs that break
those assumptions while staying inside what the spec's Model accepts:
- paged, token pool, chunked: the cache's pages (or pool slots) moved to a random permutation with the table
  following them, stale (random, in-range) entries past each sequence's last page, and every second sequence's
  first pages pointing at its neighbour's (a shared prefix);
- paged and token-pool decode: sequence lengths redrawn with an empty sequence, a one-token one and a full one;
- paged and chunked: the cache re-paged at 1 and at 64 tokens per page (engines run 1, 16, 32, 64...), the table
  following, so a kernel that assumed the page size of the spec's own inputs is caught;
- packed varlen self-attention: the tokens re-split into as many sequences with an empty and a one-token
  sequence, the longest kept at its length (a `max_seqlen` argument stays true).
The layout comes from the caller (generate names it from the spec's trace): `serving` holds the forward's argument
names (`kind`, `k`, `v`, `table`, `lengths`, `table_k`, `q_offsets`).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

__all__ = ["serving_variants", "REPAGED_SIZES"]

REPAGED_SIZES = (1, 64)  # tokens per page of the re-paged calls (a spec's own inputs usually hold 16)


def _positions(model_cls: type, names: Mapping[str, str | None]) -> dict[str, int]:
    params = list(inspect.signature(model_cls.forward).parameters.values())[1:]  # type: ignore[attr-defined]
    where = {p.name: i for i, p in enumerate(params) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return {role: where[n] for role, n in names.items() if isinstance(n, str) and n in where}


def serving_variants(model_cls: type, inputs: list[Any], serving: Mapping[str, str | None],
                     seed: int) -> list[tuple[str, list[Any]]]:
    """(what changed, new inputs) for the layout `serving`; [] when the spec's inputs do not read as that layout."""
    pos = _positions(model_cls, serving)
    gen = torch.Generator().manual_seed(seed)
    kind = serving.get("kind")
    out: list[tuple[str, list[Any]]] = []
    if kind in ("paged", "pool", "chunked") and {"k", "v", "table"} <= pos.keys():
        moved = _pages_moved_and_shared(inputs, pos, kind == "pool", gen)
        if moved is not None:
            out.append(("pages moved, stale table entries, a prefix shared", moved))
        if kind != "pool":
            for page in REPAGED_SIZES:
                repaged = _repaged(inputs, pos, page, gen)
                if repaged is not None:
                    out.append((f"the cache re-paged at {page} token{'s' * (page > 1)} per page", repaged))
        if kind != "chunked" and "lengths" in pos:  # a chunk's keys include its own queries: lengths stay
            ragged = _ragged_lengths(inputs, pos, kind == "pool", gen)
            if ragged is not None:
                out.append(("lengths redrawn with an empty, a one-token and a full sequence", ragged))
    if kind == "varlen" and "table" in pos:
        repacked = _repacked(inputs, pos, gen)
        if repacked is not None:
            out.append(("tokens re-split with an empty and a one-token sequence", repacked))
    return out


def _tokens_per_slot(inputs: list[Any], pos: Mapping[str, int], pool: bool) -> int:
    return 1 if pool else int(inputs[pos["k"]].shape[1])


def _used_slots(inputs: list[Any], pos: Mapping[str, int], pool: bool) -> torch.Tensor:
    """[B] table entries each sequence reads (all of them when the spec bounds no length)."""
    table = inputs[pos["table"]]
    if "lengths" not in pos:
        return torch.full((table.shape[0],), table.shape[1])
    per = _tokens_per_slot(inputs, pos, pool)
    return (inputs[pos["lengths"]].long().cpu() + per - 1) // per


def _pages_moved_and_shared(inputs: list[Any], pos: Mapping[str, int], pool: bool,
                            gen: torch.Generator) -> list[Any] | None:
    k, v, table = inputs[pos["k"]], inputs[pos["v"]], inputs[pos["table"]]
    if table.dim() != 2 or table.dtype not in (torch.int32, torch.int64) or k.shape[0] != v.shape[0]:
        return None
    slots = k.shape[0]
    if table.numel() and not (0 <= int(table.min()) and int(table.max()) < slots):
        return None
    perm = torch.randperm(slots, generator=gen)
    new_k, new_v = torch.empty_like(k), torch.empty_like(v)
    new_k[perm.to(k.device)], new_v[perm.to(v.device)] = k, v  # slot i's content now lives at perm[i]
    t = perm[table.long().cpu()]
    used = _used_slots(inputs, pos, pool)
    stale = torch.randint(0, slots, t.shape, generator=gen)
    t = torch.where(torch.arange(t.shape[1])[None, :] < used[:, None], t, stale)
    for b in range(1, t.shape[0], 2):  # sequence b starts with sequence b - 1's first pages
        n = int(min(used[b - 1], used[b])) // 2 or int(min(used[b - 1], used[b]))
        t[b, :n] = t[b - 1, :n]
    new = list(inputs)
    new[pos["k"]], new[pos["v"]], new[pos["table"]] = new_k, new_v, t.to(table.dtype).to(table.device)
    return new


def _repaged(inputs: list[Any], pos: Mapping[str, int], page: int, gen: torch.Generator) -> list[Any] | None:
    """The same sequences in a cache of `page` tokens per page ([NUM_PAGES, page, ...]), pages in random order, the
    table [B, ceil(MAX_PAGES * PAGE / page)] pointing at them; None where the cache already has that page size."""
    k, v, table = inputs[pos["k"]], inputs[pos["v"]], inputs[pos["table"]]
    if k.dim() < 3 or v.shape[:2] != k.shape[:2] or table.dim() != 2 or k.shape[1] == page \
            or table.dtype not in (torch.int32, torch.int64):
        return None
    b, cap = table.shape[0], table.shape[1] * k.shape[1]
    if table.numel() and not (0 <= int(table.min()) and int(table.max()) < k.shape[0]):
        return None
    per = -(-cap // page)
    new_table = torch.randperm(b * per, generator=gen).reshape(b, per)
    new = list(inputs)
    for role in ("k", "v"):
        cache = inputs[pos[role]]
        rows = cache[table.long().to(cache.device)].flatten(1, 2)  # [B, cap, ...]: each sequence's token rows
        rows = torch.cat([rows, rows.new_zeros(b, per * page - cap, *rows.shape[2:])], 1)
        paged = cache.new_empty(b * per, page, *cache.shape[2:])
        paged[new_table.flatten().to(cache.device)] = rows.reshape(b * per, page, *cache.shape[2:])
        new[pos[role]] = paged
    new[pos["table"]] = new_table.to(table.dtype).to(table.device)
    return new


def _ragged_lengths(inputs: list[Any], pos: Mapping[str, int], pool: bool, gen: torch.Generator) -> list[Any] | None:
    lengths, table = inputs[pos["lengths"]], inputs[pos["table"]]
    if lengths.dim() != 1 or lengths.dtype not in (torch.int32, torch.int64) or lengths.numel() != table.shape[0]:
        return None
    cap = table.shape[1] * _tokens_per_slot(inputs, pos, pool)
    new_len = torch.randint(1, cap + 1, lengths.shape, generator=gen)
    for i, n in enumerate((0, 1, cap)[:lengths.numel()]):
        new_len[i] = n
    new = list(inputs)
    new[pos["lengths"]] = new_len[torch.randperm(lengths.numel(), generator=gen)].to(lengths.dtype).to(lengths.device)
    return new


def _repacked(inputs: list[Any], pos: Mapping[str, int], gen: torch.Generator) -> list[Any] | None:
    cu = inputs[pos["table"]]
    if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64) or cu.numel() < 4:
        return None
    if "table_k" in pos and not torch.equal(inputs[pos["table_k"]], cu):
        return None  # queries and keys packed differently (cached prefixes): their relation is the spec's
    lens = (cu[1:] - cu[:-1]).long().cpu()
    total, longest, b = int(lens.sum()), int(lens.max()), lens.numel()
    new_lens = [longest, 0, 1] + [0] * (b - 3)
    left = total - longest - 1
    if left < 0 or left > longest * (b - 3):
        return None
    for i in range(3, b):  # what is left spread at random, none longer than the longest
        room = longest * (b - 1 - i)
        take = int(torch.randint(max(0, left - room), min(longest, left) + 1, (), generator=gen))
        new_lens[i], left = take, left - take
    order = torch.randperm(b, generator=gen).tolist()
    new_cu = torch.tensor([0] + [new_lens[i] for i in order]).cumsum(0).to(cu.dtype).to(cu.device)
    # every offsets tensor that held the queries' offsets holds the new ones (cu_seqlens_k passed as the same
    # offsets, read by the kernel even where the Model reads only cu_seqlens_q)
    return [new_cu.clone() if isinstance(x, torch.Tensor) and x.dtype == cu.dtype and x.shape == cu.shape
            and torch.equal(x, cu) else x for x in inputs]
