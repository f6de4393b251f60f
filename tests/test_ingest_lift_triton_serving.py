"""Serving kernels (packed varlen prefill, split-KV decode over a token pool or pages) lift into
complete programs verified per sequence."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ingest.fetch import fetch
from ingest.lift_triton import lift_file
from ingest.manifest import find_manifest
from ingest.model import Provenance
from kb.ir.nodes import Gather, Load, Span, walk_stmts
from kb.ir.text import parse_program, print_program
from kb.lower.serving import layout_scalars
from kb.lower.triton import lower_program
from kb.lower.triton_aot import compile_for_arch
from tests.support.repo import TEST_CACHE

# A packed prefill written the way serving stacks write it: q/k/v/o are [tokens, heads, dim], the
# sequence's first token and its length come from two tables, the KV head is the q head divided by
# a group size passed at launch, the mask is added to the scores, k is loaded as a [DIM, BN] tile.
PACKED_PREFILL = '''\
import triton
import triton.language as tl


@triton.jit
def packed_prefill(Q, K, V, scale, Starts, Lens, Out, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_vt, stride_vh, stride_ot, stride_oh, group: tl.constexpr, BM: tl.constexpr,
                   DIM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, dim_real: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    blk = tl.program_id(2)
    kv_head = head // group
    first = tl.load(Starts + seq)
    count = tl.load(Lens + seq)
    r = blk * BM + tl.arange(0, BM)
    c = tl.arange(0, BN)
    d = tl.arange(0, DIM)
    q = tl.load(Q + (first + r[:, None]) * stride_qt + head * stride_qh + d[None, :],
                mask=(r[:, None] < count) & (d[None, :] < dim_real), other=0.0)
    m = tl.zeros([BM], dtype=tl.float32) - float("inf")
    l = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DIM], dtype=tl.float32)
    hi = tl.minimum((blk + 1) * BM, count) if CAUSAL else count
    for n in range(0, hi, BN):
        cols = n + c
        k = tl.load(K + (first + cols[None, :]) * stride_kt + kv_head * stride_kh + d[:, None],
                    mask=(cols[None, :] < count) & (d[:, None] < dim_real), other=0.0)
        s = tl.zeros([BM, BN], dtype=tl.float32)
        s += tl.dot(q, k)
        s *= scale
        if CAUSAL:
            s += tl.where((cols[None, :] < count) & (r[:, None] >= cols[None, :]), 0, float("-inf"))
        else:
            s += tl.where(cols[None, :] < count, 0, float("-inf"))
        mn = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - mn[:, None])
        alpha = tl.exp(m - mn)
        v = tl.load(V + (first + cols[:, None]) * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=(cols[:, None] < count) & (d[None, :] < dim_real), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l = l * alpha + tl.sum(p, 1)
        m = mn
    tl.store(Out + (first + r[:, None]) * stride_ot + head * stride_oh + d[None, :], acc / l[:, None],
             mask=(r[:, None] < count) & (d[None, :] < dim_real))
'''


def _lift(tmp_path: Path, source: str):
    path = tmp_path / "serving_prefill.py"
    path.write_text(source)
    return lift_file(path, Provenance("local", "0", path.name, 1, 1, "triton", "1"), family="local_triton")


def test_packed_prefill_lifts_per_flag_into_verified_varlen_programs(tmp_path: Path) -> None:
    report = _lift(tmp_path, PACKED_PREFILL)
    assert not report.skipped, report.skipped
    by_causal = {p.features.causal: p for p in report.programs}
    assert set(by_causal) == {False, True} and all(p.verified for p in report.programs)
    for p in report.programs:
        assert p.features.varlen and not p.features.paged_kv
        assert "per sequence" in p.verify_note
        assert [x.name for x in p.program.params][:4] == ["q", "k", "v", "o"]
        assert p.program.param("q").shape == ("T", "Hq", "D")
        q_load = next(st for st in walk_stmts(p.program.kernels[0].body) if isinstance(st, Load) and st.tensor == "q")
        assert isinstance(q_load.index[0], Span) and q_load.index[0].until is not None
        assert parse_program(print_program(p.program)) == p.program
    # the sequence's own key bound is not a variant mask: the programs classify as plain and causal
    assert (by_causal[False].features.mask, by_causal[True].features.mask) == ("none", "causal")
    assert "q_idx >= kv_idx" in str(by_causal[True].program.mask_mod.body)
    assert "q_idx" not in str(by_causal[False].program.mask_mod.body)
    assert "Hq // Hkv" in print_program(by_causal[True].program)  # the launch-time group size


def test_a_wrong_sequence_start_fails_verification(tmp_path: Path) -> None:
    # v rows read from the *next* token: the program still lifts, the per-sequence check refuses it
    broken = PACKED_PREFILL.replace("V + (first + cols[:, None])", "V + (first + 1 + cols[:, None])")
    report = _lift(tmp_path, broken)
    assert not any(p.verified for p in report.programs)
    assert report.skipped and all("k rows" in why or "mismatch" in why or "start" in why for _, why in report.skipped)


@pytest.mark.network
def test_sglang_prefill_lifts_from_the_pinned_wheel() -> None:
    os.environ["KB_CACHE_DIR"] = str(TEST_CACHE)
    src = fetch(find_manifest("sglang"))
    path = src.root / "sglang/kernels/ops/attention/prefill_attention.py"
    report = lift_file(path, Provenance("sglang", "0.5.23", "prefill_attention.py", 1, 1, "triton", "1"), family="sglang_triton")
    assert sorted(p.name for p in report.programs if p.verified) == ["sglang_triton_fwd_kernel", "sglang_triton_fwd_kernel_is_causal"]


# A split-KV decode over a token pool, written the way serving stacks write it: one query row per
# (sequence, head, split) as a [DIM] vector, the scores a reduced product, each KV lane's pool row
# read from the sequence's row of a token table, the length from a second table; the partial output
# and its log-sum-exp go to two scratch buffers that a merge kernel folds over the splits.
POOL_SPLIT_DECODE = '''\
import triton
import triton.language as tl


@triton.jit
def pool_decode_partial(Q, KPool, VPool, scale, TokTable, Lens, Part, PartLse, stride_qb, stride_qh,
                        stride_kslot, stride_kh, stride_vslot, stride_vh, stride_tab, stride_pb, stride_ph,
                        stride_ps, group: tl.constexpr, SPLITS: tl.constexpr, BN: tl.constexpr,
                        DIM: tl.constexpr, dim_real: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    part = tl.program_id(2)
    kv_head = head // group
    d = tl.arange(0, DIM)
    length = tl.load(Lens + seq)
    q = tl.load(Q + seq * stride_qb + head * stride_qh + d, mask=d < dim_real, other=0.0)
    chunk = tl.cdiv(length, SPLITS)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, length)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([DIM], dtype=tl.float32)
    for n in range(lo, hi, BN):
        cols = n + tl.arange(0, BN)
        slot = tl.load(TokTable + seq * stride_tab + cols, mask=cols < hi, other=0)
        k = tl.load(KPool + slot[:, None] * stride_kslot + kv_head * stride_kh + d[None, :],
                    mask=(cols[:, None] < hi) & (d[None, :] < dim_real), other=0.0)
        s = tl.sum(q[None, :] * k, 1) * scale
        s = tl.where(cols < hi, s, float("-inf"))
        v = tl.load(VPool + slot[:, None] * stride_vslot + kv_head * stride_vh + d[None, :],
                    mask=(cols[:, None] < hi) & (d[None, :] < dim_real), other=0.0)
        mn = tl.maximum(tl.max(s, 0), m)
        alpha = tl.exp(m - mn)
        p = tl.exp(s - mn)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l = l * alpha + tl.sum(p, 0)
        m = mn
    base = seq * stride_pb + head * stride_ph + part * stride_ps
    tl.store(Part + base + d, acc / l, mask=d < dim_real)
    tl.store(PartLse + seq * SPLITS * stride_ph // stride_ps + head * SPLITS + part, m + tl.log(l))


@triton.jit
def pool_decode_merge(Part, PartLse, Lens, Out, stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
                      SPLITS: tl.constexpr, DIM: tl.constexpr, dim_real: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, DIM)
    length = tl.load(Lens + seq)
    chunk = tl.cdiv(length, SPLITS)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([DIM], dtype=tl.float32)
    for part in range(0, SPLITS):
        if tl.minimum(part * chunk + chunk, length) > part * chunk:
            o = tl.load(Part + seq * stride_pb + head * stride_ph + part * stride_ps + d, mask=d < dim_real)
            lse = tl.load(PartLse + (seq * stride_pb + head * stride_ph) // stride_ps + part)
            mn = tl.maximum(lse, m)
            acc = acc * tl.exp(m - mn) + tl.exp(lse - mn) * o
            l = l * tl.exp(m - mn) + tl.exp(lse - mn)
            m = mn
    tl.store(Out + seq * stride_ob + head * stride_oh + d, acc / l, mask=d < dim_real)
'''


def _gathered(p, tensor: str) -> bool:
    loads = [st for k in p.kernels for st in walk_stmts(k.body) if isinstance(st, Load) and st.tensor == tensor]
    return bool(loads) and all(isinstance(st.index[0], Gather) for st in loads)


def test_pool_split_decode_lifts_into_a_verified_split_and_merge_program(tmp_path: Path) -> None:
    report = _lift(tmp_path, POOL_SPLIT_DECODE)
    assert not report.skipped, report.skipped
    (lifted,) = report.programs
    assert lifted.verified and "per sequence" in lifted.verify_note, lifted.verify_note
    prog = lifted.program
    assert [k.name for k in prog.kernels] == ["split", "combine"]
    assert _gathered(prog, "k") and _gathered(prog, "v")
    assert prog.param("q").shape == ("B", "Hq", "D")
    f = lifted.features
    assert f.paged_kv and f.split_kv and f.decode and f.mask == "none" and f.gqa_ratio != 0
    assert "Hq // Hkv" in print_program(prog)
    assert parse_program(print_program(prog)) == prog


def test_a_decode_reading_the_wrong_pool_row_is_refused(tmp_path: Path) -> None:
    # the next token's pool row for both k and v: the program lifts, the per-sequence check refuses it
    broken = POOL_SPLIT_DECODE.replace("TokTable + seq * stride_tab + cols,", "TokTable + seq * stride_tab + cols + 1,")
    report = _lift(tmp_path, broken)
    assert not report.programs
    assert [why for _, why in report.skipped if "mismatch" in why] == [why for _, why in report.skipped] != []
    # v one pool row off k: refused when lifting (k and v of a lane must be the same token)
    report = _lift(tmp_path, POOL_SPLIT_DECODE.replace("VPool + slot[:, None]", "VPool + (slot[:, None] + 1)"))
    assert not report.programs and "rows differ" in report.skipped[0][1]


# The vLLM way: the launcher folds log2(e) into the scale it passes (a module constant), the kernel
# runs exp2 on `qk * scale` and masks with a large finite number instead of -inf.
LAUNCHER_SCALED = PACKED_PREFILL.replace("import triton.language as tl\n", "import triton.language as tl\n\nRCP_LN2 = 1.4426950216\n") \
    .replace('s += tl.where((cols[None, :] < count) & (r[:, None] >= cols[None, :]), 0, float("-inf"))',
             's = tl.where((cols[None, :] < count) & (r[:, None] >= cols[None, :]), s, -1.0e8)') \
    .replace('s += tl.where(cols[None, :] < count, 0, float("-inf"))', 's = tl.where(cols[None, :] < count, s, -1.0e8)') \
    .replace("tl.exp(", "tl.exp2(") + '''

def prefill(q, k, v, o, starts, lens, max_len, scale, group, causal):
    scale *= RCP_LN2
    grid = (starts.numel(), q.shape[1], triton.cdiv(max_len, 64))
    packed_prefill[grid](q, k, v, scale, starts, lens, o, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         v.stride(0), v.stride(1), o.stride(0), o.stride(1), group=group, BM=64,
                         DIM=triton.next_power_of_2(q.shape[2]), BN=64, CAUSAL=causal, dim_real=q.shape[2])
'''


def test_a_launcher_that_folds_log2e_into_the_scale_lifts_with_notes(tmp_path: Path) -> None:
    report = _lift(tmp_path, LAUNCHER_SCALED)
    assert len(report.programs) == 2 and all(p.verified for p in report.programs), report.skipped
    notes = " ".join(report.programs[0].notes)
    assert "multiplies the softmax scale by log2(e)" in notes and "-1e+08, not -inf" in notes
    # the same kernel launched with the natural scale runs exp2 on natural-log scores: refused
    unscaled = _lift(tmp_path, LAUNCHER_SCALED.replace("    scale *= RCP_LN2\n", ""))
    assert not unscaled.programs and all("exp2 on natural-log scores" in why for _, why in unscaled.skipped)


@pytest.mark.network
def test_vllm_prefill_lifts_from_the_pinned_wheel() -> None:
    os.environ["KB_CACHE_DIR"] = str(TEST_CACHE)
    src = fetch(find_manifest("vllm"))
    path = src.root / "vllm/v1/attention/ops/triton_prefill_attention.py"
    report = lift_file(path, Provenance("vllm", "0.33.0", "vllm/v1/attention/ops/triton_prefill_attention.py", 1, 1,
                                        "triton", "1"), family="vllm_triton")
    assert sorted(p.name for p in report.programs if p.verified) == ["vllm_triton_fwd_kernel", "vllm_triton_fwd_kernel_is_causal"]


def _pinned(dist: str, rel: str, family: str):
    os.environ["KB_CACHE_DIR"] = str(TEST_CACHE)
    path = fetch(find_manifest(dist)).root / rel
    return lift_file(path, Provenance(dist, "0", path.name, 1, 1, "triton", "1"), family=family)


@pytest.mark.network
def test_sglang_split_decode_lifts_from_the_pinned_wheel() -> None:
    report = _pinned("sglang", "sglang/kernels/ops/attention/decode_attention.py", "sglang_triton")
    p, grouped = sorted((p for p in report.programs if p.verified), key=lambda p: "grouped" in p.name)
    assert p.name == "sglang_triton_fwd_kernel_stage1" and "token pool" in p.verify_note
    assert grouped.name == "sglang_triton_fwd_grouped_kernel_stage1" and _spans_heads(grouped.program)
    assert p.features.paged_kv and p.features.split_kv and p.features.decode
    assert _gathered(p.program, "k") and "kv_indices[" in print_program(p.program)


@pytest.mark.network
def test_vllm_split_decode_lifts_from_the_pinned_wheel() -> None:
    report = _pinned("vllm", "vllm/v1/attention/ops/triton_decode_attention.py", "vllm_triton")
    p, grouped = sorted((p for p in report.programs if p.verified), key=lambda p: "grouped" in p.name)
    assert grouped.name == "vllm_triton_fwd_grouped_kernel_stage1" and _spans_heads(grouped.program)
    assert "page table" in grouped.verify_note and grouped.features.paged_kv and grouped.features.split_kv
    assert p.name == "vllm_triton_fwd_kernel_stage1" and "page table" in p.verify_note
    assert p.features.paged_kv and p.features.split_kv and p.features.decode
    assert "PAGE_SIZE * req_to_tokens[b, (j + n_start) // PAGE_SIZE]" in print_program(p.program)
    # the tiles vLLM launches on NVIDIA GPUs (BLOCK = 32, num_stages = 2), not its `if is_hip_:` ones (16, 1)
    s = grouped.program.schedule
    assert (s.block_n, s.num_stages, s.num_warps) == (32, 2, 4)
    # its page size divides the lanes' token indices: the kernels take it as a constexpr (a shift, not a division)
    assert layout_scalars(grouped.program) == ("PAGE_SIZE",)
    src = lower_program(grouped.program)
    assert "    PAGE_SIZE: tl.constexpr," in src and "PAGE_SIZE=PAGE_SIZE" in src
    # and it builds for sm_90 at that schedule (page size 16), pipelined, without spills
    kernels = compile_for_arch(grouped.program, arch=90, head_dim=128, tma=False)
    assert kernels and all(k.local_stores == 0 for k in kernels)


# The production GQA decode: the query heads that share one KV head are the rows of one tl.dot tile.
# Program ids are (sequence, head group, split); a group holds `per` = min(ROWS, group) heads, masked
# at the group's end and at the head count; pages of PAGE tokens through a per-sequence page table.
GROUPED_DECODE = '''\
import triton
import triton.language as tl


@triton.jit
def grouped_partial(Q, KCache, VCache, scale, Pages, Lens, Part, PartLse, s_qb, s_qh, s_page, s_tok, s_kh,
                    s_pb, s_ph, s_ps, s_tab, group: tl.constexpr, n_heads: tl.constexpr, SPLITS: tl.constexpr,
                    PAGE: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr, DIM: tl.constexpr,
                    dim_real: tl.constexpr):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    part = tl.program_id(2)
    kv_head = tile // tl.cdiv(group, ROWS)
    per: tl.constexpr = ROWS if group > ROWS else group
    heads = tile * per + tl.arange(0, ROWS)
    live = (heads < (tile + 1) * per) & (heads < n_heads)
    d = tl.arange(0, DIM)
    length = tl.load(Lens + seq)
    q = tl.load(Q + seq * s_qb + heads[:, None] * s_qh + d[None, :],
                mask=live[:, None] & (d[None, :] < dim_real), other=0.0)
    chunk = tl.cdiv(length, SPLITS)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, length)
    m = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
    l = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DIM], dtype=tl.float32)
    for n in range(lo, hi, BN):
        cols = n + tl.arange(0, BN)
        page = tl.load(Pages + seq * s_tab + cols // PAGE, mask=cols < hi, other=0)
        row = page * s_page + (cols % PAGE) * s_tok
        k = tl.load(KCache + row[None, :] + kv_head * s_kh + d[:, None],
                    mask=(cols[None, :] < hi) & (d[:, None] < dim_real), other=0.0)
        s = tl.dot(q, k) * scale
        s = tl.where(live[:, None] & (cols[None, :] < hi), s, float("-inf"))
        v = tl.load(VCache + row[:, None] + kv_head * s_kh + d[None, :],
                    mask=(cols[:, None] < hi) & (d[None, :] < dim_real), other=0.0)
        mn = tl.maximum(tl.max(s, 1), m)
        alpha = tl.exp(m - mn)
        p = tl.exp(s - mn[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l = l * alpha + tl.sum(p, 1)
        m = mn
    at = seq * s_pb + heads * s_ph + part * s_ps
    tl.store(Part + at[:, None] + d[None, :], acc / l[:, None], mask=live[:, None] & (d[None, :] < dim_real))
    tl.store(PartLse + at // dim_real, m + tl.log(l), mask=live)
''' + POOL_SPLIT_DECODE[POOL_SPLIT_DECODE.index("@triton.jit\ndef pool_decode_merge"):]


def _spans_heads(p) -> bool:
    """The q tile of the split kernel is a span over q's head dim, ended at the group's last head."""
    (q_load,) = [st for st in walk_stmts(p.kernels[0].body) if isinstance(st, Load) and st.tensor == "q"]
    return isinstance(q_load.index[1], Span) and q_load.index[1].size == "BLOCK_M" and q_load.index[1].until is not None


def test_grouped_decode_lifts_with_a_q_tile_over_the_heads_of_a_group(tmp_path: Path) -> None:
    report = _lift(tmp_path, GROUPED_DECODE)
    assert not report.skipped, report.skipped
    (lifted,) = report.programs
    assert lifted.verified and "(6, 2)" in lifted.verify_note, lifted.verify_note  # a ragged group of 3 heads
    prog = lifted.program
    assert _spans_heads(prog) and _gathered(prog, "k")
    text = print_program(prog)
    assert "grid(b: B, g: cdiv(Hq, " in text and "grid(b: B, h: Hq)" in text  # head groups, then per-head combine
    assert "g // cdiv(Hq // Hkv, BLOCK_M)" in text  # the KV head of the group
    f = lifted.features
    assert f.paged_kv and f.split_kv and f.decode and f.mask == "none"
    assert parse_program(text) == prog


def test_a_grouped_decode_with_a_per_row_mask_is_refused(tmp_path: Path) -> None:
    # a condition mixing each row's head with the keys cannot be one mask_mod call per tile
    report = _lift(tmp_path, GROUPED_DECODE.replace("live[:, None] & (cols[None, :] < hi)",
                                                    "live[:, None] & (cols[None, :] < hi) & (cols[None, :] >= heads[:, None])"))
    assert not report.programs and "reads each row's head" in report.skipped[0][1], report.skipped
