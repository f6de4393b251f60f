"""Decode as the experts do it: GQA packing (the query heads of a KV head share one tile, so K/V are read once
per KV head and split), the flash-decoding split count, a combine that reads each partial once, the verifier
accepting honest split-KV kernels, and `kb generate` on a decode spec within its time bound."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generate.designs import Sweep, rank_designs
from kb.features import Features
from kb.ir.design import AUTO_SPLITS, Design, parse_design
from kb.ir.nodes import Dtype, Param, Role
from kb.lower.pack_gqa import pack_plans
from kb.lower.runtime import load_module
from kb.lower.triton import lower_program
from tests.support.attn_reference import reference_attention
from tests.support.ir_programs import FIXTURES, decode_split_kv
from verify import Verdict, VerifyOptions, verify

ROOT = Path(__file__).resolve().parents[1]
TOL = {Dtype.F32: 1e-4, Dtype.BF16: 2e-2}
TORCH = {Dtype.F32: torch.float32, Dtype.BF16: torch.bfloat16}


def _qkv(B: int, Hq: int, Hkv: int, M: int, N: int, D: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((Hq, M), (Hkv, N), (Hkv, N))]


def _run(p, design: tuple, qkv: list[torch.Tensor], tag: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    mod = load_module(lower_program(p), f"decode_{tag}")[0]
    return mod.forward(*qkv, _design=design, **kw)


# ------------------------------------------------------------------ GQA packing


@pytest.mark.parametrize("Hq,Hkv,M", [(8, 1, 1), (8, 1, 3), (4, 2, 1), (4, 2, 3)], ids=["mqa-m1", "mqa-m3", "gqa-m1", "gqa-m3"])
@pytest.mark.parametrize("dtype", [Dtype.F32, Dtype.BF16], ids=["f32", "bf16"])
def test_packed_decode_matches_reference(Hq: int, Hkv: int, M: int, dtype: Dtype) -> None:
    # ragged N = 517: no split and no block is a multiple of the 32-wide KV blocks; 8 x 3 = 24 packed rows > BLOCK_M
    p = decode_split_kv(dtype=dtype)
    qkv = _qkv(2, Hq, Hkv, M, 517, 32, TORCH[dtype])
    ref, lse_ref = reference_attention(p, *qkv)
    for splits, pack in ((3, True), (5, True), (3, False)):  # 17 KV blocks of 32: 6 and 4 blocks per split
        o, lse = _run(p, (16, 32, splits, 4, 1, False, pack), qkv, f"{dtype.value}")
        tol = TOL[dtype]
        torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, lse_ref, atol=tol, rtol=tol)


def test_packed_rows_see_their_own_head_and_position() -> None:
    # a per-head score_mod (ALiBi-like, from an aux tensor) and a bottom-right causal mask over M = 3 query
    # tokens (speculative decoding): each packed row must use its own query head and query position
    slopes = Param("slopes", ("Hq",), Dtype.F32, Role.AUX)
    p = decode_split_kv(score_mod="score + slopes[h] * (kv_idx - q_idx)", mask_mod="q_idx + (N - M) >= kv_idx",
                        aux=(slopes,))
    assert isinstance(pack_plans(p), dict)
    qkv = _qkv(2, 8, 2, 3, 45, 16, torch.float32, seed=3)
    aux = {"slopes": torch.rand(8, generator=torch.Generator().manual_seed(4))}
    ref, lse_ref = reference_attention(p, *qkv, aux=aux)
    o, lse = _run(p, (16, 16, 3, 4, 1, False, True), qkv, "mods", **aux)
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)


def test_packing_refused_where_it_would_be_wrong() -> None:
    # causal prefill bounds its KV loop by the query block: a packed tile mixes query positions
    why = pack_plans(FIXTURES["causal"]())
    assert isinstance(why, str) and "bounds of loop" in why
    src = lower_program(FIXTURES["causal"]())
    assert "_packed_kernel" not in src
    table = {"sm90": {128: (Design(64, 64, 4, 3, pack_gqa=True),)}}
    assert "# GQA packing: not used, kernel fwd: the bounds of loop" in lower_program(FIXTURES["causal"](), designs=table)
    # a program that cannot pack lists its designs unpacked, so the table says what runs
    table = {"sm90": {128: (Design(64, 64, 4, 3, pack_gqa=True), Design(64, 64, 4, 3))}}
    mod = load_module(lower_program(FIXTURES["causal"](), designs=table), "decode_refused")[0]
    assert mod.DESIGNS["sm90"][128] == [(64, 64, 1, 4, 3, True, False)]


def test_split_kv_program_verifies_its_packed_form() -> None:
    mod = load_module(lower_program(FIXTURES["decode_split_kv"]()), "decode_own")[0]
    assert mod.PROGRAM_DESIGN[6] is True  # what the interpreter runs (and the verifier checks) is the packed form
    assert Design.from_tuple(mod.PROGRAM_DESIGN[:6]).pack_gqa is False  # 6-tuples from older modules: no packing


def test_design_text_round_trips_packing() -> None:
    d = Design(16, 64, 4, 3, AUTO_SPLITS, pack_gqa=True)
    assert str(d) == "16x64 w4 s3 split-auto pack" and parse_design(str(d)) == d
    assert Design.from_tuple(d.as_tuple()) == d and Design.from_dict(d.to_dict()) == d


# ------------------------------------------------------------------ split count and combine


def test_split_rule_fills_two_waves_of_whole_block_splits() -> None:
    mod = load_module(lower_program(FIXTURES["decode_split_kv"]()), "decode_rule")[0]
    rule = mod._split_rule  # (programs at one split, KV blocks, SMs) -> splits
    assert rule(512, 256, 132) == 1  # GQA B=64, Hkv=8 packed: 512 programs already fill ~4 waves of an H200
    assert rule(128, 256, 132) == 3  # MQA B=128 packed: 128 programs -> 384, ~3 full waves
    assert rule(128, 8, 132) == 2  # short KV: no split below 4 blocks
    assert rule(8, 256, 132) == 32  # B=1, Hkv=8: 33 would fill 2 waves exactly, but leaves a split empty -> 32
    for programs, blocks in ((1, 10_000), (3, 1000), (64, 512), (200, 17), (1, 3)):
        n = rule(programs, blocks, 132)
        per = -(-blocks // n)
        assert 1 <= n <= 128 and (n == 1 or per >= 4) and per * (n - 1) < blocks  # no empty split
    assert mod._auto_splits(128, 256, torch.device("cpu")) == 1


def test_combine_reads_one_split_at_a_time() -> None:
    src = lower_program(FIXTURES["decode_split_kv"]())
    combine = src[src.index("def _combine_kernel("):src.index("def _split_packed_kernel(")]
    assert "for _sp in range(0, NUM_SPLITS):" in combine and "po = tl.load" not in combine


# ------------------------------------------------------------------ design ranking


def test_decode_ranks_packed_designs_first_until_packing_is_measured() -> None:
    gqa = Features(mask="none", decode=True, split_kv=True, gqa_ratio=4, head_dim=128, dtype="bf16")
    fa2 = [("sm90", 128, {"block_m": 64, "block_n": 128, "num_warps": 4, "split_kv": True})]
    unpacked = Sweep("k-1", gqa, "sm90", 128, ((Design(16, 64, 2, 2, AUTO_SPLITS), 1.0),))
    ranked = rank_designs(gqa, "sm90", 128, [unpacked], fa2)
    assert ranked[0] == Design(16, 64, 4, 3, AUTO_SPLITS, pack_gqa=True) and ranked[0].block_n in (64, 128)
    assert Design(16, 64, 2, 2, AUTO_SPLITS, pack_gqa=True) in ranked[:8]  # the measured tile, packed, is a candidate
    # once a sweep timed packed designs beside unpacked ones, the measurements decide
    tuned = Sweep("k-2", gqa, "sm90", 128, ((Design(16, 128, 8, 3, AUTO_SPLITS, pack_gqa=True), 0.5),
                                            (Design(16, 64, 4, 3, AUTO_SPLITS, pack_gqa=True), 0.7),
                                            (Design(16, 64, 2, 2, AUTO_SPLITS), 1.2)))
    assert rank_designs(gqa, "sm90", 128, [tuned], fa2)[0] == Design(16, 128, 8, 3, AUTO_SPLITS, pack_gqa=True)
    assert all(d.fits("sm90", 128) for d in ranked)


# ------------------------------------------------------------------ the verifier accepts honest split-KV


def _candidate(tmp_path: Path, design: tuple, name: str) -> Path:
    """A KernelBench candidate running the split-KV decode program at `design` (the harness's CPU run)."""
    src = lower_program(decode_split_kv(dtype=Dtype.BF16)) + (
        "\n\nclass ModelNew(torch.nn.Module):\n"
        "    def forward(self, q, k_cache, v_cache):\n"
        f"        return forward(q, k_cache, v_cache, _design={design!r})[0]\n")
    path = tmp_path / f"{name}.py"
    path.write_text(src)
    return path


@pytest.mark.parametrize("pack", [True, False], ids=["gqa-packed", "split-kv"])
def test_verifier_accepts_honest_split_kv(pack: bool, tmp_path: Path) -> None:
    # 5 splits: the partials (B x Hq x 5 x M x D fp32) are copied back by the interpreter through set_/copy_
    spec = ROOT / "tests" / "support" / "verify_fixtures" / "decode_gqa_spec.py"
    opts = VerifyOptions(distributions=("normal",), max_cases=2, timeout_s=300)
    r = verify(spec, _candidate(tmp_path, (16, 16, 5, 4, 1, False, pack), f"honest_{pack}"), opts)
    assert r.verdict is Verdict.passed, r.message


# ------------------------------------------------------------------ kb generate on a decode spec

# a hang guard, not a time bound (CI machines are loaded; bench/generate_time.py times generation)
_HANG_GUARD_S = 1800


def _generate(home: Path, spec: Path, out: Path) -> dict:
    """The report of `kb generate SPEC` run as a user runs it (a fresh process, the full harness)."""
    env = {**os.environ, "KB_HOME": str(home)}
    env.pop("TRITON_INTERPRET", None)  # the CLI sets up its own verification processes
    proc = subprocess.run([sys.executable, "-m", "cli.main", "generate", str(spec), "--out", str(out), "--no-backward", "--target", "sm90",
                           "--no-memory"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=_HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / f"gen_{spec.stem}.report.json").read_text())


@pytest.mark.network  # the session KB ingests the real flash-attn release
def test_generate_decode_spec_packs_gqa(ingested_kb_settings, tmp_path: Path) -> None:
    # 8 query heads on 2 KV heads, one token over 70 cached keys, bf16 (examples/specs/decode_gqa_splitkv.py is the
    # same at 32/8 heads and 2048 keys, D = 128: about 30 s more of the interpreter for the same decisions)
    spec = ROOT / "tests" / "support" / "verify_fixtures" / "decode_gqa_spec.py"
    report = _generate(ingested_kb_settings.home, spec, tmp_path / "out")
    assert report["status"] == "verified", report.get("error")
    mod = (tmp_path / "out" / f"gen_{spec.stem}_triton.py").read_text()
    listed = [d for ds in report["designs"]["sm90"].values() for d in ds]
    assert "_split_packed_kernel" in mod and listed and all(d.endswith(" pack") for d in listed)
