"""How a serving program's params take a serving spec's forward inputs, as they are (no repacking).

A lifted decode program reads its KV cache either as token rows [POOL, Hkv, D] through a per-lane table (vLLM's
and SGLang's Triton decode: row = PAGE_SIZE * table[b, n // PAGE_SIZE] + n % PAGE_SIZE) or as pages
[NUM_PAGES, PAGE, Hkv, D] one page per KV tile. A vLLM cache [NUM_PAGES, PAGE, Hkv, D] is token rows after
`flatten(0, 1)` (a view of a contiguous cache), with the page size as the program's integer scalar; a token
pool [POOL, Hkv, D] (SGLang's req_to_token) is token rows of page size 1. The binding says which: the IR check
(generate.attempts) and the generated operator (generate.candidate_serving) both apply it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from generate.spec_serving import ServingLayout
from generate.transfer_serving import serving_params
from kb.errors import KBError
from kb.ir.expr import free_vars
from kb.ir.nodes import Dtype, Program, Role

__all__ = ["ServingBinding", "bind", "program_inputs"]


@dataclass(frozen=True)
class ServingBinding:
    """program param -> the spec's forward input it takes, and how the cache is viewed."""

    inputs: tuple[tuple[str, str], ...]  # (program param, spec forward input name)
    token_rows: bool  # the program reads k/v as [rows, Hkv, D]: a paged cache is passed as cache.flatten(0, 1)
    page_size: str | None  # the program's integer scalar that takes the cache's page size (1 for a token pool)
    max_rows: str | None = None  # varlen: the program's integer scalar sizing its query-block grid (q's token count)


def bind(program: Program, layout: ServingLayout) -> ServingBinding:
    """The binding of `program` (a transferred decode program) to the spec's inputs; KBError when it cannot take them."""
    if layout.kind == "varlen":
        return _bind_varlen(program, layout)
    if layout.kind == "chunked":
        return _bind_chunked(program, layout)
    if layout.lengths is None or layout.table is None:
        raise KBError("a serving program needs the spec's page table and sequence lengths")
    params = {p.name: p for p in program.params}
    table, lengths = serving_params(program)
    if (table, lengths) != (layout.table, layout.lengths):
        raise KBError(f"program {program.name} reads {table}/{lengths}, the spec passes {layout.table}/{layout.lengths}")
    rank = len(params["k"].shape)
    ints = [p.name for p in program.params if p.role is Role.SCALAR and p.dtype in (Dtype.I32, Dtype.I64)]
    if rank == 3:  # token rows
        if layout.kind == "paged" and not ints:
            raise KBError(f"program {program.name} reads token rows through a token table; the spec's table lists pages")
        page_size = ints[0] if ints else None
    elif rank == 4 and layout.kind == "paged":
        page_size = None
    else:
        raise KBError(f"program {program.name} reads k as a rank-{rank} tensor; the spec's {layout.describe} cache "
                      "does not fit it")
    pairs = (("q", layout.q), ("k", layout.k), ("v", layout.v), (table, layout.table), (lengths, layout.lengths))
    return ServingBinding(pairs, rank == 3, page_size)


def _bind_varlen(program: Program, layout: ServingLayout) -> ServingBinding:
    """A packed prefill program (generate.transfer_serving) takes q, k, v and the offsets as they are; its grid's
    integer scalar takes q's token count, a bound on any sequence's length (blocks past a sequence's end do nothing)."""
    ints = [p.name for p in program.params if p.role is Role.SCALAR and p.dtype in (Dtype.I32, Dtype.I64)]
    offsets = tuple(dict.fromkeys(t for t in (layout.table, layout.table_k) if t is not None))
    if len(ints) != 1 or any(t not in {p.name for p in program.params} for t in offsets):
        raise KBError(f"program {program.name} is not a packed prefill over {', '.join(offsets)}")
    pairs = (("q", layout.q), ("k", layout.k), ("v", layout.v), *((t, t) for t in offsets))
    return ServingBinding(pairs, False, None, ints[0])


def _grid_scalars(program: Program) -> set[str]:
    return set().union(*(free_vars(ax.extent) for k in program.kernels for ax in k.grid))


def _bind_chunked(program: Program, layout: ServingLayout) -> ServingBinding:
    """A chunked prefill program (generate.transfer_serving) takes the packed queries, their offsets, the cache's
    token rows (`flatten(0, 1)`), the page table and the lengths as they are; of its two integer scalars, the one
    sizing the query-block grid takes q's token count, the other the cache's page size."""
    ints = [p.name for p in program.params if p.role is Role.SCALAR and p.dtype in (Dtype.I32, Dtype.I64)]
    grid = [n for n in ints if n in _grid_scalars(program)]
    page = [n for n in ints if n not in grid]
    tables = (layout.q_offsets, layout.table, layout.lengths)
    if len(grid) != 1 or len(page) != 1 or len(program.param("k").shape) != 3 \
            or any(t not in {p.name for p in program.params} for t in tables):
        raise KBError(f"program {program.name} is not a chunked prefill over {', '.join(map(str, tables))}")
    pairs = (("q", layout.q), ("k", layout.k), ("v", layout.v), *((t, t) for t in tables if t is not None))
    return ServingBinding(pairs, True, page[0], grid[0])


def program_inputs(binding: ServingBinding, args: Mapping[str, Any]) -> dict[str, Any]:
    """The program's tensor and integer inputs from the spec's forward inputs `args` (by name)."""
    out: dict[str, Any] = {}
    cache = args[dict(binding.inputs)["k"]]
    for param, name in binding.inputs:
        x = args[name]
        if param in ("k", "v") and binding.token_rows and x.dim() == 4:
            x = x.flatten(0, 1)
        out[param] = x
    if binding.page_size is not None:
        out[binding.page_size] = cache.shape[1] if cache.dim() == 4 else 1
    if binding.max_rows is not None:
        out[binding.max_rows] = args[dict(binding.inputs)["q"]].shape[0]
    return out

