"""Decode as the experts do it: GQA packing (the query heads of a KV head share one tile, so K/V are read once
per KV head and split), the flash-decoding split count, a combine that reads each partial once, the verifier
accepting honest split-KV kernels, and `kb generate` on a decode spec within its time bound."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kb.ir.design import AUTO_SPLITS, Design, parse_design
from kb.ir.nodes import Dtype, Param, Role
from kb.lower.pack_gqa import pack_plans
from kb.lower.runtime import load_module
from kb.lower.triton import lower_program
from tests.attn_reference import reference_attention
from tests.ir_programs import FIXTURES, decode_split_kv

ROOT = Path(__file__).resolve().parents[1]
TOL = {Dtype.F32: 1e-4, Dtype.BF16: 2e-2}
TORCH = {Dtype.F32: torch.float32, Dtype.BF16: torch.bfloat16}


def _qkv(B: int, Hq: int, Hkv: int, M: int, N: int, D: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((Hq, M), (Hkv, N), (Hkv, N))]


def _run(p, design: tuple, qkv: list[torch.Tensor], tag: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    mod = load_module(lower_program(p), f"decode_{tag}")[0]
    return mod.forward(*qkv, _design=design, **kw)


# ------------------------------------------------------------------ GQA packing


@pytest.mark.parametrize("Hq,Hkv,M", [(8, 1, 1), (8, 1, 3), (4, 2, 1), (4, 2, 3)], ids=["mqa-m1", "mqa-m3", "gqa-m1", "gqa-m3"])
@pytest.mark.parametrize("dtype", [Dtype.F32, Dtype.BF16], ids=["f32", "bf16"])
def test_packed_decode_matches_reference(Hq: int, Hkv: int, M: int, dtype: Dtype) -> None:
    # ragged N = 517: no split and no block is a multiple of the 16-wide KV blocks; 8 x 3 = 24 packed rows > BLOCK_M
    p = decode_split_kv(dtype=dtype)
    qkv = _qkv(2, Hq, Hkv, M, 517, 32, TORCH[dtype])
    ref, lse_ref = reference_attention(p, *qkv)
    for splits in (3, 5):
        for pack in (True, False):
            o, lse = _run(p, (16, 16, splits, 4, 1, False, pack), qkv, f"{dtype.value}")
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
    assert "_packed_kernel" not in src and "# GQA packing: not available, kernel fwd: the bounds of loop" in src
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
