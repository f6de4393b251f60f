"""The reference interpreter executes IR programs exactly: every fixture matches dense fp32
attention on ragged shapes, GQA/MQA, seq_q != seq_kv, fully masked rows and split-KV decode;
block skipping really skips; unstored outputs stay poisoned; bad inputs raise KBError."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from kb.errors import KBError
from kb.ir.expr import parse_expr as E
from kb.ir.interp_softmax import combine, online_softmax_step
from kb.ir.interpret import interpret, run_program
from kb.ir.nodes import Dtype, For, GridAxis, Program, Role, Schedule
from kb.ir.text import parse_program
from tests.support.attn_reference import reference_attention
from tests.support.ir_programs import FIXTURES, decode_split_kv, document, forward, sliding_window

SM_SCALE = 0.3
SOFTCAP = 4.0
LOW = {Dtype.BF16: torch.bfloat16, Dtype.F16: torch.float16}
TOL = {Dtype.F32: 1e-5, Dtype.BF16: 2e-2, Dtype.F16: 3e-3}


class Shape(NamedTuple):
    B: int
    Hq: int
    Hkv: int
    M: int
    N: int
    D: int


# ragged lengths (not multiples of BLOCK_M = BLOCK_N = 16), GQA 2:1 and MQA, D=24 -> HEAD_PAD 32
SHAPES = [Shape(2, 4, 2, 37, 37, 16), Shape(1, 2, 1, 1, 50, 24), Shape(2, 4, 1, 20, 45, 24)]


def make_inputs(p: Program, s: Shape, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    inputs: dict = {
        "q": torch.randn(s.B, s.Hq, s.M, s.D, generator=g).to(dtype),
        "k": torch.randn(s.B, s.Hkv, s.N, s.D, generator=g).to(dtype),
        "v": torch.randn(s.B, s.Hkv, s.N, s.D, generator=g).to(dtype),
        "sm_scale": SM_SCALE,
    }
    names = {prm.name for prm in p.params}
    if "softcap" in names:
        inputs["softcap"] = SOFTCAP
    if "slopes" in names:
        inputs["slopes"] = torch.rand(s.Hq, generator=g) + 0.1
    if "doc_ids" in names:  # 3 documents of random lengths per batch row
        inputs["doc_ids"] = torch.randint(0, 3, (s.B, s.N), generator=g).sort(dim=-1).values.to(torch.int32)
    return inputs


def reference(p: Program, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    scalars = {k: v for k, v in inputs.items() if k in ("softcap",)}
    aux = {k: v for k, v in inputs.items() if k in ("slopes", "doc_ids")}
    return reference_attention(p, inputs["q"], inputs["k"], inputs["v"], SM_SCALE, scalars, aux)


def assert_matches(out: dict, ref: tuple[torch.Tensor, torch.Tensor], tol: float) -> None:
    o, lse = out["o"], out["lse"]
    assert lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.float(), ref[0], atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref[1], atol=tol, rtol=tol)


# ---------------------------------------------------------------- every fixture vs. dense torch


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s.B}Hq{s.Hq}Hkv{s.Hkv}M{s.M}N{s.N}D{s.D}")
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_matches_reference_fp32(name: str, shape: Shape) -> None:
    p = FIXTURES[name]()
    inputs = make_inputs(p, shape)
    out = run_program(p, inputs)
    assert out["o"].dtype == torch.float32 and out["o"].shape == (shape.B, shape.Hq, shape.M, shape.D)
    assert_matches(out, reference(p, inputs), TOL[Dtype.F32])


@pytest.mark.parametrize("dtype", [Dtype.BF16, Dtype.F16], ids=lambda d: d.value)
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_low_precision_inputs(name: str, dtype: Dtype) -> None:
    p = FIXTURES[name](dtype=dtype)
    inputs = make_inputs(p, Shape(1, 4, 2, 37, 45, 16), LOW[dtype], seed=1)
    out = run_program(p, inputs)
    assert out["o"].dtype == LOW[dtype]  # o in o's dtype, lse in fp32
    assert_matches(out, reference(p, inputs), TOL[dtype])


# ---------------------------------------------------------------- fully masked rows


def _masked_rows_case(p: Program, s: Shape) -> None:
    inputs = make_inputs(p, s, seed=2)
    out = run_program(p, inputs)
    ref_o, ref_lse = reference(p, inputs)
    dead = torch.isinf(ref_lse)
    assert dead.any() and not dead.all(), "the case must have both fully masked and live rows"
    assert torch.equal(out["lse"][dead], ref_lse[dead])  # -inf exactly
    assert torch.equal(out["o"][dead], torch.zeros_like(out["o"][dead]))
    assert_matches(out, (ref_o, ref_lse), TOL[Dtype.F32])


def test_sliding_window_bottom_rows_fully_masked() -> None:
    # M > N: rows q >= N + 7 see no key; block 1 visits a KV block where rows 17.. are all -inf,
    # blocks 2-3 have an empty KV loop
    _masked_rows_case(sliding_window(window=8), Shape(1, 2, 1, 50, 10, 16))


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]], ids=["square", "cross"])
def test_strict_causal_first_row_fully_masked(shape: Shape) -> None:
    p = forward("strict_causal", mask_mod="kv_idx < q_idx", hi="minimum(N, m_start + BLOCK_M)", block_classes=True)
    _masked_rows_case(p, shape)


def test_mask_mod_blinding_some_rows() -> None:
    _masked_rows_case(forward("blind_rows", mask_mod="q_idx % 3 != 1"), SHAPES[2])


def test_online_softmax_state_stays_finite_on_all_masked_rows() -> None:
    m, l, acc = torch.full((2,), -math.inf), torch.zeros(2), torch.zeros(2, 4)
    s = torch.tensor([[-math.inf, -math.inf, -math.inf], [0.5, -math.inf, 1.0]])
    m, l, acc = online_softmax_step(m, l, acc, s, torch.ones(3, 4))
    assert m[0] == -math.inf and l[0] == 0 and torch.equal(acc[0], torch.zeros(4))
    assert not torch.isnan(acc).any() and torch.allclose(l[1], torch.exp(torch.tensor(-0.5)) + 1)


def test_combine_ignores_empty_parts_even_if_poisoned() -> None:
    o_parts = torch.stack([torch.full((2, 4), float("nan")), torch.ones(2, 4), 2 * torch.ones(2, 4)])
    lse_parts = torch.tensor([[-math.inf, -math.inf], [0.0, -math.inf], [0.0, -math.inf]])
    o, lse = combine(o_parts, lse_parts)
    assert torch.allclose(o[0], torch.full((4,), 1.5)) and torch.allclose(lse[0], torch.tensor(math.log(2)))
    assert torch.equal(o[1], torch.zeros(4)) and lse[1] == -math.inf


# ---------------------------------------------------------------- GQA and seq_q != seq_kv


def test_gqa_maps_query_head_to_kv_head_by_division() -> None:
    p = FIXTURES["gqa"]()
    s = Shape(1, 4, 2, 20, 20, 16)
    inputs = make_inputs(p, s, seed=3)
    out = run_program(p, inputs)
    rep = s.Hq // s.Hkv
    mha = {**inputs, "k": inputs["k"].repeat_interleave(rep, 1), "v": inputs["v"].repeat_interleave(rep, 1)}
    wrong = {**inputs, "k": inputs["k"].repeat(1, rep, 1, 1), "v": inputs["v"].repeat(1, rep, 1, 1)}
    torch.testing.assert_close(out["o"], run_program(p, mha)["o"], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out["o"], run_program(p, wrong)["o"], atol=1e-2)  # h % Hkv would differ


def test_bottom_right_causal_with_longer_kv() -> None:
    p = forward("causal_bottom_right", mask_mod="q_idx + (N - M) >= kv_idx", hi="minimum(N, m_start + BLOCK_M + N - M)")
    inputs = make_inputs(p, SHAPES[2], seed=4)
    assert_matches(run_program(p, inputs), reference(p, inputs), TOL[Dtype.F32])


def test_reverse_kv_order_gives_the_same_result() -> None:
    p = FIXTURES["causal"]()
    fwd = p.kernels[0]
    body = tuple(dataclasses.replace(st, order="reverse") if isinstance(st, For) else st for st in fwd.body)
    rev = dataclasses.replace(p, kernels=(dataclasses.replace(fwd, body=body),))
    inputs = make_inputs(p, SHAPES[0], seed=5)
    assert_matches(run_program(rev, inputs), reference(p, inputs), TOL[Dtype.F32])


# ---------------------------------------------------------------- split-KV decode


def _chunk(N: int, S: int, bn: int = 16) -> int:
    return math.ceil(math.ceil(N / S) / bn) * bn


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 8])
def test_decode_split_kv_any_number_of_splits(num_splits: int) -> None:
    p = decode_split_kv(num_splits=num_splits)
    s = Shape(2, 4, 1, 1, 50, 24)
    inputs = make_inputs(p, s, seed=num_splits)
    res = interpret(p, inputs)
    assert_matches(res.outputs, reference(p, inputs), TOL[Dtype.F32])
    split = res.stats.kernel("split")
    assert split.grid_points == s.B * s.Hq * num_splits
    # together the splits visit every KV block exactly once
    assert split.kv_blocks_visited == s.B * s.Hq * math.ceil(s.N / 16)
    empty_splits = sum(i * _chunk(s.N, num_splits) >= s.N for i in range(num_splits))
    assert empty_splits == {1: 0, 2: 0, 3: 1, 5: 1, 8: 4}[num_splits]


# ---------------------------------------------------------------- block skipping statistics


def _stats(p: Program, s: Shape, seed: int = 6, **extra):
    inputs = {**make_inputs(p, s, seed=seed), **extra}
    res = interpret(p, inputs)
    assert_matches(res.outputs, reference(p, inputs), TOL[Dtype.F32])
    return res.stats.kernel("fwd")


def test_block_skipping_causal_and_sliding_window() -> None:
    s = Shape(1, 1, 1, 128, 128, 16)  # 8 x 8 blocks of 16
    plain, causal = _stats(FIXTURES["plain"](), s), _stats(FIXTURES["causal"](), s)
    window = _stats(sliding_window(window=24), s)
    assert (plain.kv_blocks_visited, plain.kv_blocks_skipped) == (64, 0)
    assert (causal.kv_blocks_visited, causal.kv_blocks_dense) == (36, 64)  # lower triangle incl. diagonal
    assert (causal.full_blocks, causal.partial_blocks, causal.empty_blocks) == (28, 8, 0)
    assert causal.masks_applied == 8  # full blocks are not masked at all
    # window 24 < 2 blocks: at most 3 blocks per query block
    assert window.kv_blocks_visited == 1 + 2 + 3 * 6 and window.kv_blocks_visited < causal.kv_blocks_visited


def test_block_classes_find_empty_blocks_across_documents() -> None:
    s = Shape(1, 1, 1, 64, 64, 16)
    doc_ids = torch.arange(64).div(16, rounding_mode="floor").view(1, 64).to(torch.int32)  # one doc per block
    st = _stats(document(), s, doc_ids=doc_ids)
    assert (st.kv_blocks_visited, st.full_blocks, st.partial_blocks, st.empty_blocks) == (10, 0, 4, 6)


def test_ragged_kv_block_is_never_full() -> None:
    # every in-range pair attends, so only the ragged last KV block (32..47 of N=37) needs the bounds mask
    p = forward("all_pairs", mask_mod="kv_idx >= 0", block_classes=True)
    st = _stats(p, Shape(1, 2, 1, 37, 37, 16))
    grid = 1 * 2 * 3
    assert (st.full_blocks, st.partial_blocks, st.empty_blocks) == (2 * grid, grid, 0)
    assert st.masks_applied == grid


def test_stores_write_exactly_the_in_range_elements() -> None:
    s = SHAPES[0]
    res = interpret(FIXTURES["plain"](), make_inputs(FIXTURES["plain"](), s))
    assert res.stats.kernel("fwd").elements_stored == s.B * s.Hq * s.M * (s.D + 1)
    assert res.dims["HEAD_PAD"] == 16 and res.stats.kernel("fwd").grid_points == s.B * s.Hq * 3


# ---------------------------------------------------------------- poisoned outputs


def test_unstored_outputs_stay_poisoned() -> None:
    p = FIXTURES["plain"]()
    fwd = p.kernels[0]
    short = dataclasses.replace(fwd, grid=fwd.grid[:2] + (GridAxis("m", E("cdiv(M, BLOCK_M) - 1")),))
    p = dataclasses.replace(p, kernels=(short,))
    inputs = make_inputs(p, SHAPES[0])
    out = run_program(p, inputs)
    assert torch.isnan(out["o"][:, :, 32:]).all() and torch.isnan(out["lse"][:, :, 32:]).all()
    ref_o, ref_lse = reference(p, inputs)
    torch.testing.assert_close(out["o"][:, :, :32], ref_o[:, :, :32], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the documented example


def test_docs_example_runs_and_matches_causal_reference() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "ir.md").read_text()
    text = re.search(r"```\n(program causal\n.*?)```", doc, re.S).group(1)
    p = parse_program(text)
    inputs = make_inputs(p, SHAPES[2], seed=7)
    assert_matches(run_program(p, inputs), reference(p, inputs), TOL[Dtype.F32])


# ---------------------------------------------------------------- errors users can cause


def test_inconsistent_dims_are_rejected() -> None:
    p = FIXTURES["plain"]()
    inputs = make_inputs(p, SHAPES[0])
    with pytest.raises(KBError, match="dim D is 16 .* 8"):
        run_program(p, {**inputs, "k": inputs["k"][..., :8]})
    with pytest.raises(KBError, match="dim B"):
        run_program(p, {**inputs, "v": inputs["v"][:1]})


def test_missing_unknown_and_mistyped_inputs_are_rejected() -> None:
    p = FIXTURES["softcap"]()
    inputs = make_inputs(p, SHAPES[0])
    with pytest.raises(KBError, match="softcap"):
        run_program(p, {k: v for k, v in inputs.items() if k != "softcap"})
    with pytest.raises(KBError, match="not input/aux/scalar"):
        run_program(p, {**inputs, "o": torch.zeros(1)})
    with pytest.raises(KBError, match="float64"):
        run_program(p, {**inputs, "q": inputs["q"].double()})


def test_aux_int_width_is_adapted() -> None:
    p = document()
    inputs = make_inputs(p, SHAPES[0])
    out = run_program(p, {**inputs, "doc_ids": inputs["doc_ids"].long()})
    assert_matches(out, reference(p, inputs), TOL[Dtype.F32])


def test_in_range_out_of_bounds_aux_read_is_an_error_not_a_clamp() -> None:
    # doc_ids is [B, N] but indexed by q_idx: with M > N an in-range query row reads past its end
    p = document()
    with pytest.raises(KBError, match="doc_ids out of range"):
        run_program(p, make_inputs(p, Shape(1, 2, 1, 40, 20, 16)))


def test_unbound_dim_asks_for_shapes() -> None:
    p = FIXTURES["plain"]()
    extra = dataclasses.replace(p.param("o"), name="extra", shape=("B", "T"), role=Role.OUT)
    p = dataclasses.replace(p, params=p.params + (extra,))
    inputs = make_inputs(p, SHAPES[0])
    with pytest.raises(KBError, match="shapes="):
        run_program(p, inputs)
    out = run_program(p, inputs, shapes={"T": 3})
    assert out["extra"].shape == (2, 3) and torch.isnan(out["extra"]).all()  # allocated, never stored


def test_program_errors_name_kernel_point_and_statement() -> None:
    p = forward("bad", score_mod="score + undefined_thing")
    with pytest.raises(KBError, match=r"kernel fwd at \(b=0, h=0, m=0\), `score_mod s at .*undefined_thing"):
        run_program(p, make_inputs(p, SHAPES[0]))


def test_schedule_head_pad_smaller_than_d_is_rejected() -> None:
    p = dataclasses.replace(FIXTURES["plain"](), schedule=Schedule(block_m=16, block_n=16, head_pad=16))
    with pytest.raises(KBError, match="HEAD_PAD=16 is smaller than D=24"):
        run_program(p, make_inputs(p, SHAPES[1]))


def test_wide_head_pad_gives_same_result() -> None:
    p = dataclasses.replace(FIXTURES["causal"](), schedule=Schedule(block_m=8, block_n=32, head_pad=64))
    inputs = make_inputs(p, SHAPES[2])
    assert_matches(run_program(p, inputs), reference(p, inputs), TOL[Dtype.F32])

