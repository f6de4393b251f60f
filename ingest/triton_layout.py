"""Where a kernel's q/k/v/o rows live: dense [B, H, S, D] tensors, packed tokens [T, H, D] (varlen), or a
decode row per (b, h) (or a tile of the query heads that share a KV head) over KV rows gathered from a token pool or a flattened page cache.

A serving kernel (vLLM and SGLang prefill) addresses row `r` of sequence `b` at token
`start(b) + r`, with `start` loaded from a table (`b_start_loc[b]`, `cu_seqlens[b]`) and the rows
bounded by a loaded length. That is read off the q pointer: the row-stride term of its offset
is `start + m * BLOCK_M + lane` where `start` holds a load. The IR form is a span with an `until`:
`q[q0 + m_start:+BLOCK_M until q0 + q_len, h, :]` (docs/ir.md, serving layouts).

A decode kernel (vLLM and SGLang split-KV decode) loads one q row `q[b, h, :]` and reads KV lane `j`
of the block at `n_start` from the pool row a table gives (`kv_indices[kv_indptr[b] + n_start + j]`,
`req_to_tokens[b, (n_start + j) // PAGE] * PAGE + (n_start + j) % PAGE`): the IR form is a gathered
axis, `k[[row for j in range(BLOCK_N) if n_start + j < kv_len], hk, :]`, with `kv_len` the length.
"""

from __future__ import annotations

from dataclasses import dataclass

from kb.ir.expr import Expr, ExprOp, call, var, walk
from kb.ir.nodes import Dtype, Full, Gather, Index, Param, Role, Span
from kb.ir.algebra import from_poly, to_poly

__all__ = ["Layout", "DENSE", "split_start"]


def split_start(idx: Expr) -> tuple[Expr | None, Expr]:
    """`load(t, b) + m * BLOCK_M + _r` -> (`load(t, b)`, `m * BLOCK_M + _r`); (None, idx) without a load."""
    poly = to_poly(idx)
    loaded = {m: c for m, c in poly.items() if any(x.op is ExprOp.LOAD for a in m for x in walk(a))}
    if not loaded:
        return None, idx
    return from_poly(loaded), from_poly({m: c for m, c in poly.items() if m not in loaded})


@dataclass(frozen=True)
class Layout:
    """Dense when `start` is None; else packed tokens, sequence rows [q0, q0 + q_len) (lets in the program)."""

    start: Expr | None = None  # the value of `q0`
    length: Expr | None = None  # the value of `q_len` (packed) or `kv_len` (decode)
    kv_row: Expr | None = None  # decode: the pool row of KV lane `j` (over `n_start`, `j`, tables)
    tables: tuple[Param, ...] = ()  # decode: the integer tables the row and the length load
    head0: Expr | None = None  # grouped decode: the first query head of group `g` (the value of `h0`)
    heads_until: Expr | None = None  # grouped decode: the end of the group's heads (`h0:+BLOCK_M until ...`)

    @property
    def packed(self) -> bool:
        return self.start is not None

    @property
    def decode(self) -> bool:
        return self.kv_row is not None

    @property
    def grouped(self) -> bool:
        """A decode tile whose rows are the query heads sharing one KV head (grid axis `g`, not `h`)."""
        return self.head0 is not None

    def kv(self, head: str, n_start: Expr) -> tuple[Index, ...]:
        """The index of a [BLOCK_N, D] k or v tile of the KV block at `n_start`."""
        if not self.decode:
            return self.rows(head, n_start, "BLOCK_N")
        valid = n_start + var("j") < var("kv_len")
        return (Gather("j", "BLOCK_N", self.kv_row, valid), var(head), Full())  # type: ignore[arg-type]

    def rows(self, head: str, first: Expr, size: str, *, head_dim: bool = True) -> tuple[Index, ...]:
        """The index of a [size, D] tile (or a [size] row statistic) of rows first.. of head `head`."""
        tail: tuple[Index, ...] = (Full(),) if head_dim else ()
        if self.grouped:  # the group's query heads
            return (var("b"), Span(var("h0"), "BLOCK_M", until=self.heads_until)) + tail
        if self.decode:  # one query row per (b, h)
            return (var("b"), Span(var(head), 1)) + tail
        if not self.packed:
            return (var("b"), var(head), Span(first, size)) + tail
        return (Span(var("q0") + first, size, until=var("q0") + var("q_len")), var(head)) + tail


    def params(self) -> list[Param]:
        if self.decode:
            return [Param("q", ("B", "Hq", "D"), Dtype.F16, Role.IN),
                    Param("k", ("POOL", "Hkv", "D"), Dtype.F16, Role.IN),
                    Param("v", ("POOL", "Hkv", "D"), Dtype.F16, Role.IN),
                    Param("o", ("B", "Hq", "D"), Dtype.F16, Role.OUT),
                    Param("lse", ("B", "Hq"), Dtype.F32, Role.OUT), *self.tables]
        if not self.packed:
            return [Param("q", ("B", "Hq", "M", "D"), Dtype.F16, Role.IN),
                    Param("k", ("B", "Hkv", "N", "D"), Dtype.F16, Role.IN),
                    Param("v", ("B", "Hkv", "N", "D"), Dtype.F16, Role.IN),
                    Param("o", ("B", "Hq", "M", "D"), Dtype.F16, Role.OUT),
                    Param("lse", ("B", "Hq", "M"), Dtype.F32, Role.OUT)]
        return [Param("q", ("T", "Hq", "D"), Dtype.F16, Role.IN),
                Param("k", ("T", "Hkv", "D"), Dtype.F16, Role.IN),
                Param("v", ("T", "Hkv", "D"), Dtype.F16, Role.IN),
                Param("o", ("T", "Hq", "D"), Dtype.F16, Role.OUT),
                Param("lse", ("T", "Hq"), Dtype.F32, Role.OUT),
                Param("max_seq_len", (), Dtype.I32, Role.SCALAR)]

    def query_blocks(self) -> Expr:
        return call("cdiv", var("max_seq_len" if self.packed else "M"), var("BLOCK_M"))


DENSE = Layout()
