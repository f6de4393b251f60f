"""Serving regions (paged KV, varlen, split-KV combine) are found by dataflow in kernels the tests write."""

from __future__ import annotations

import ast
from pathlib import Path

from ingest.lift_triton import lift_file
from ingest.model import Provenance
from ingest.triton_regions import serving_regions

# A token-pool decode written with unusual names: the page lookup `rows` is read per KV block and
# addresses the k and v tiles; `n_ctx` (a length read once) bounds the loop; the dot is a reduced product.
POOL_DECODE = '''\
import triton
import triton.language as tl


@triton.jit
def decode_step(Qp, Kpool, Vpool, pool_index, lengths, Part, scale, s_qb, s_qh, s_kt, s_kh, s_ix, s_pb, s_ph,
                GROUP: tl.constexpr, BN: tl.constexpr, DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    n_ctx = tl.load(lengths + seq)
    d = tl.arange(0, DIM)
    qv = tl.load(Qp + seq * s_qb + head * s_qh + d)
    mx = float("-inf")
    den = 0.0
    acc = tl.zeros([DIM], dtype=tl.float32)
    for start in range(0, n_ctx, BN):
        cols = start + tl.arange(0, BN)
        rows = tl.load(pool_index + seq * s_ix + cols, mask=cols < n_ctx, other=0)
        kt = tl.load(Kpool + rows[:, None] * s_kt + (head // GROUP) * s_kh + d[None, :], mask=(cols < n_ctx)[:, None])
        s = tl.sum(qv[None, :] * kt, 1) * scale
        s = tl.where(cols < n_ctx, s, float("-inf"))
        new = tl.maximum(tl.max(s, 0), mx)
        p = tl.exp(s - new)
        vt = tl.load(Vpool + rows[:, None] * s_kt + (head // GROUP) * s_kh + d[None, :], mask=(cols < n_ctx)[:, None])
        acc = acc * tl.exp(mx - new) + tl.sum(p[:, None] * vt, 0)
        den = den * tl.exp(mx - new) + tl.sum(p, 0)
        mx = new
    tl.store(Part + seq * s_pb + head * s_ph + d, acc / den)


@triton.jit
def merge_parts(O, Parts, Lses, n_parts, s_o, s_p, DIM: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, DIM)
    best = float("-inf")
    total = 0.0
    acc = tl.zeros([DIM], dtype=tl.float32)
    for i in range(0, n_parts):
        lse = tl.load(Lses + row * n_parts + i)
        part = tl.load(Parts + (row * n_parts + i) * s_p + d)
        top = tl.maximum(best, lse)
        acc = acc * tl.exp(best - top) + part * tl.exp(lse - top)
        total = total * tl.exp(best - top) + tl.exp(lse - top)
        best = top
    tl.store(O + row * s_o + d, acc / total)
'''

# A varlen prefill: `first` (read once per program) offsets the packed q/k/v rows.
VARLEN_PREFILL = '''\
import triton
import triton.language as tl


@triton.jit
def packed_fwd(Q, K, V, O, starts, lens, scale, s_t, s_h, BM: tl.constexpr, BN: tl.constexpr, DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    blk = tl.program_id(2)
    first = tl.load(starts + seq)
    count = tl.load(lens + seq)
    r = blk * BM + tl.arange(0, BM)
    c = tl.arange(0, BN)
    d = tl.arange(0, DIM)
    q = tl.load(Q + (first + r[:, None]) * s_t + head * s_h + d[None, :], mask=r[:, None] < count)
    m = tl.zeros([BM], dtype=tl.float32) - float("inf")
    l = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DIM], dtype=tl.float32)
    for n in range(0, count, BN):
        k = tl.load(K + (first + n + c[None, :]) * s_t + head * s_h + d[:, None], mask=(n + c[None, :]) < count)
        s = tl.dot(q, k) * scale
        s = tl.where((n + c[None, :]) < count, s, float("-inf"))
        mn = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - mn[:, None])
        alpha = tl.exp(m - mn)
        v = tl.load(V + (first + n + c[:, None]) * s_t + head * s_h + d[None, :], mask=(n + c[:, None]) < count)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l = l * alpha + tl.sum(p, 1)
        m = mn
    tl.store(O + (first + r[:, None]) * s_t + head * s_h + d[None, :], acc / l[:, None], mask=r[:, None] < count)
'''


def _regions(source: str, name: str) -> list[tuple[str, int]]:
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return [(r.kind, r.start) for r in serving_regions(fn)]


def _line(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


def test_token_pool_decode_has_a_paged_region_and_a_length_region() -> None:
    found = _regions(POOL_DECODE, "decode_step")
    assert ("paged_kv", _line(POOL_DECODE, "rows = tl.load")) in found
    assert ("varlen", _line(POOL_DECODE, "n_ctx = tl.load")) in found
    assert not [k for k, line in found if line == _line(POOL_DECODE, "qv = tl.load")]  # the q tile is no table


def test_merge_of_partials_is_a_combine_region() -> None:
    assert _regions(POOL_DECODE, "merge_parts") == [("split_kv_combine", _line(POOL_DECODE, "def merge_parts"))]


def test_varlen_offsets_are_found_and_tiles_are_not() -> None:
    found = _regions(VARLEN_PREFILL, "packed_fwd")
    assert ("varlen", _line(VARLEN_PREFILL, "first = tl.load")) in found
    assert ("varlen", _line(VARLEN_PREFILL, "count = tl.load")) in found
    assert all(kind == "varlen" for kind, _ in found) and len(found) == 2


def test_lift_file_keeps_the_regions_as_snippets_with_their_source(tmp_path: Path) -> None:
    path = tmp_path / "serving.py"
    path.write_text(POOL_DECODE)
    report = lift_file(path, Provenance("local", "0", "serving.py", 1, 1, "triton", "1"))
    kinds = {s.kind: s for s in report.snippets}
    assert {"paged_kv", "split_kv_combine"} <= set(kinds)
    paged = kinds["paged_kv"]
    assert "rows = tl.load(pool_index" in paged.text and paged.features == {"paged_kv": True}
    assert paged.provenance.line_start == _line(POOL_DECODE, "rows = tl.load")
