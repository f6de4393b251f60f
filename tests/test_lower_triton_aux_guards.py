"""Aux loads whose indices mix tiles and constants (`t[q_idx, 0]`, attention-gym's `intervals[i][0]`, VSA's
`topk[b, h, q_idx // 64, 0]`) run under the Triton interpreter: the constant indices' in-range tests gate the
others through `tl.where` (a tile `&` scalar mask is int32 there, "mask has unsupported dtype")."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

from pathlib import Path

import torch

from kb.ir.nodes import Dtype, Param, Role
from kb.lower.runtime import TritonKernel
from kb.lower.triton import lower_program
from tests.support.attn_reference import reference_attention
from tests.support.ir_programs import forward


def test_mixed_tile_and_scalar_indices(tmp_path: Path) -> None:
    p = forward("mixed_guards", score_mod="score + t[q_idx, 0] * 0.5 - t[kv_idx, 1] * 0.25",
                mask_mod="(q_idx >= iv[ids[kv_idx], 0]) & (q_idx < iv[ids[kv_idx], 1])",
                aux=(Param("t", ("M", "t_n1"), Dtype.F32, Role.AUX), Param("ids", ("N",), Dtype.I64, Role.AUX),
                     Param("iv", ("iv_n0", "iv_n1"), Dtype.I64, Role.AUX)))
    assert "mask=tl.where(" in lower_program(p)
    g = torch.Generator().manual_seed(0)
    B, H, M, D = 2, 2, 37, 16
    qkv = {n: torch.randn(B, H, M, D, generator=g) for n in "qkv"}
    aux = {"t": torch.randn(M, 2, generator=g), "ids": torch.arange(M) // 10,
           "iv": torch.tensor([[0, 20], [5, 30], [10, 37], [15, 37]])}
    out = TritonKernel.from_program(p, tmp_path).run({**qkv, **aux})
    o_ref, lse_ref = reference_attention(p, qkv["q"], qkv["k"], qkv["v"], aux=aux)
    torch.testing.assert_close(out["o"].float(), o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["lse"], lse_ref, atol=1e-4, rtol=1e-4)
