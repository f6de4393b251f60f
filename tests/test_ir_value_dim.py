"""Value heads of their own width (D_v != D_qk, MLA-style): IR, spec tracing, transfer, lowering, verify.

v is [B, Hkv, N, Dv] and o [B, Hq, M, Dv] while q/k keep D; programs with D_v == D_qk are unchanged.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from generate.check_backward import check_backward_program
from generate.pipeline import GenerateOptions, generate
from generate.spec import load_spec
from generate.target import target_for
from generate.transfer import Strategy, transfer
from kb.errors import KBError
from kb.ir.design import Design
from kb.ir.features import derive_features
from kb.ir.interpret import run_program
from kb.ir.nodes import Dtype, Param, Role
from kb.ir.text import parse_program, print_program
from kb.ir.validate import problems, validate
from kb.ir.value_dim import has_value_dim, with_value_dim, without_value_dim
from kb.lower.cuda import lower_program as lower_cuda
from kb.lower.cuda_build import BuildMode, build, find_nvcc
from kb.lower.runtime import TritonKernel, load_module
from kb.lower.triton import lower_program as lower_triton
from kb.lower.triton_aot import compile_for_arch
from kb.lower.triton_bwd import lower_autograd
from kb.store import Kernel
from tests.support.attn_reference import reference_attention
from tests.support.backward import transferred_programs
from tests.support.ir_programs import FIXTURES, alibi, causal
from verify import VerifyOptions, verify

D_QK, D_V = 64, 128

_KERNELBENCH = '''
import math
import torch
import torch.nn as nn

B, H, S, D, DV = 1, 2, 40, {d}, {dv}


class Model(nn.Module):
    def forward(self, q, k, v):
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        n = q.shape[2]
{score}        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return s.softmax(-1) @ v


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn({v_shape})]


def get_init_inputs():
    return []
'''
_SOFTCAP = "        s = 20.0 * torch.tanh(s / 20.0)\n"


def _spec(tmp_path: Path, name: str, *, score: str = "", v_shape: str = "B, H, S, DV", d: int = 32, dv: int = 64) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(_KERNELBENCH.format(d=d, dv=dv, score=score, v_shape=v_shape))
    return path


# ------------------------------------------------------------------ IR


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_text_round_trip_with_value_dim(name: str) -> None:
    p = with_value_dim(FIXTURES[name]())
    validate(p)
    text = print_program(p)
    assert "param v: [B, Hkv, N, Dv]" in text and "param o: [B, Hq, M, Dv]" in text
    assert "full(BLOCK_M, HEAD_PAD_V; 0.0)" in text and "param q: [B, Hq, M, D]" in text
    assert parse_program(text) == p
    assert has_value_dim(p) and without_value_dim(p) == FIXTURES[name]()


def test_split_kv_partials_take_the_value_dim() -> None:
    p = with_value_dim(FIXTURES["decode_split_kv"]())
    assert p.param("o_part").shape[-1] == "Dv" and p.param("lse_part").shape[-1] == "M"


def test_validator_rules_for_the_value_dim() -> None:
    p = with_value_dim(causal())
    bad_q = [prm if prm.name != "q" else Param("q", ("B", "Hq", "M", "Dv"), Dtype.F32, Role.IN) for prm in p.params]
    assert any("only values and outputs take Dv" in str(x) for x in problems(replace(p, params=tuple(bad_q))))
    mixed = replace(without_value_dim(p), params=p.params)  # acc HEAD_PAD again, v and o Dv: the softmax state disagrees
    assert any("shape mismatch" in str(x) for x in problems(mixed))


def _qkv(B: int, Hq: int, Hkv: int, M: int, N: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, M, D_QK, generator=g).to(dtype), torch.randn(B, Hkv, N, D_QK, generator=g).to(dtype),
            torch.randn(B, Hkv, N, D_V, generator=g).to(dtype))


@pytest.mark.parametrize("name", ["causal", "gqa", "decode_split_kv"])
def test_interpreter_matches_torch_on_a_ragged_shape(name: str) -> None:
    p = with_value_dim(FIXTURES[name]())
    hkv = 1 if name == "gqa" else 2
    q, k, v = _qkv(2, 2, hkv, 37, 45)  # neither length a multiple of the 16-wide blocks
    out = run_program(p, {"q": q, "k": k, "v": v, "sm_scale": 1 / math.sqrt(D_QK)})
    o_ref, lse_ref = reference_attention(p, q, k, v)
    assert out["o"].shape == (2, 2, 37, D_V)
    torch.testing.assert_close(out["o"], o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["lse"], lse_ref, atol=1e-5, rtol=1e-5)


def test_features_keep_the_query_key_head_dim() -> None:
    assert derive_features(with_value_dim(causal()), shapes={"D": D_QK}).head_dim == D_QK


# ------------------------------------------------------------------ lowering


@pytest.mark.parametrize("name,dtype", [("causal", Dtype.F32), ("alibi", Dtype.BF16), ("decode_split_kv", Dtype.F32)])
def test_triton_lowering_matches_torch(name: str, dtype: Dtype, tmp_path: Path) -> None:
    p = with_value_dim(FIXTURES[name](dtype=dtype))
    tdt = torch.float32 if dtype is Dtype.F32 else torch.bfloat16
    q, k, v = _qkv(1, 2, 2, 29, 37, tdt)
    aux = {"slopes": torch.rand(2)} if name == "alibi" else {}
    out = TritonKernel.from_program(p, tmp_path).run({"q": q, "k": k, "v": v, **aux})
    o_ref, _ = reference_attention(p, q, k, v, aux=aux)
    assert out["o"].shape == (1, 2, 29, D_V) and out["o"].dtype == tdt
    tol = 1e-4 if dtype is Dtype.F32 else 2e-2
    torch.testing.assert_close(out["o"].float(), o_ref, atol=tol, rtol=tol)


def test_split_kv_combine_with_a_padded_query_dim_and_an_exact_value_dim(tmp_path: Path) -> None:
    """D_qk = 48 (padded to 64: EVEN_D false) with D_v = 32 (EVEN_DV true), MLA's 192/128 in small: split-KV decode
    with the two head-dim masks disagreeing, through the streaming combine."""
    p = with_value_dim(FIXTURES["decode_split_kv"](dtype=Dtype.F32))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, m, d, generator=g) for m, d in ((1, 48), (37, 48), (37, 32)))
    out = TritonKernel.from_program(p, tmp_path).run({"q": q, "k": k, "v": v})
    o_ref, _ = reference_attention(p, q, k, v)
    torch.testing.assert_close(out["o"], o_ref, atol=1e-4, rtol=1e-4)


def test_triton_source_pads_values_separately() -> None:
    src = lower_triton(with_value_dim(causal(Dtype.BF16)))
    assert "acc = tl.full([BLOCK_M, HEAD_PAD_V], 0.0, tl.float32)" in src
    assert "shape=[N, Dv], strides=[stride_v_2, 1], block_shape=[BLOCK_N, HEAD_PAD_V]" in src
    assert "HEAD_PAD_V = max(16, triton.next_power_of_2(Dv))" in src and "EVEN_DV = HEAD_PAD_V == Dv" in src
    assert "HEAD_PAD_V" not in lower_triton(causal(Dtype.BF16))  # one head dim: the source of today


def test_triton_compiles_for_hopper_at_mla_head_dims() -> None:
    """The real Triton compiler (no GPU needed) takes the Dv program at D=192, Dv=128 with TMA and wgmma."""
    p = Design(128, 64, 8, 3).apply(with_value_dim(causal(Dtype.BF16)))
    (k,) = compile_for_arch(p, arch=90, head_dim=192, head_dim_v=128, tma=True)
    assert k.wgmma > 0 and k.tma_loads > 0 and k.shared_bytes <= 227 * 1024


def test_cuda_source_compiles_with_a_value_head_pad(tmp_path: Path) -> None:
    try:
        find_nvcc()
    except KBError as err:
        pytest.skip(str(err))
    src = lower_cuda(with_value_dim(causal(Dtype.BF16)))
    assert "template <int HEAD_PAD, int HEAD_PAD_V>" in src and "kb_run_v<KB_HEAD_PAD_ONLY>" in src
    res = build(src, tmp_path, BuildMode.OBJECT, name="causal_dv", opt="-O1",
                defines=("KB_HEAD_PAD_ONLY=64", "KB_HEAD_PAD_V_ONLY=128"), timeout_s=300)
    assert res.ok, res.log[-2000:]


def test_design_fit_counts_the_value_tiles() -> None:
    d = Design(128, 128, 8, 3)
    assert d.shared_bytes(64, head_dim_v=256) > d.shared_bytes(64) and d.shared_bytes(64, head_dim_v=64) == d.shared_bytes(64)
    assert d.fits("sm90", 64) and not d.fits("sm90", 64, head_dim_v=256)


# ------------------------------------------------------------------ specs and transfer


def test_kernelbench_spec_carries_dv(tmp_path: Path) -> None:
    s = load_spec(_spec(tmp_path, "causal_dv"))
    assert (s.shapes.D, s.shapes.Dv, s.shapes.value_dim) == (32, 64, True)
    program = transfer(causal(), target_for(s), Strategy.DERIVE)
    assert program.param("v").shape[-1] == "Dv" and program.param("o").shape[-1] == "Dv"


def test_spec_without_value_heads_keeps_one_head_dim(tmp_path: Path) -> None:
    s = load_spec(_spec(tmp_path, "causal_same", dv=32))
    assert not s.shapes.value_dim
    assert transfer(with_value_dim(causal()), target_for(s), Strategy.REUSE).param("v").shape[-1] == "D"


def test_flex_spec_shapes_take_dv(tmp_path: Path) -> None:
    path = tmp_path / "flex_dv.py"
    path.write_text("def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n\n"
                    "SHAPES = dict(B=1, Hq=2, M=24, D=16, Dv=48, dtype='fp32')\n")
    s = load_spec(path)
    assert (s.shapes.D, s.shapes.Dv) == (16, 48)


@pytest.mark.parametrize("v_shape,says", [("B, 1, S, DV", "heads"), ("B, H, S + 3, DV", "length")])
def test_bad_value_tensor_is_a_one_line_error(tmp_path: Path, v_shape: str, says: str) -> None:
    with pytest.raises(KBError) as err:
        load_spec(_spec(tmp_path, "bad", v_shape=v_shape))
    msg = str(err.value)
    assert "\n" not in msg and "must match k" in msg and says in msg


# ------------------------------------------------------------------ end to end


@pytest.fixture
def reference_kb(kb):
    for p in (causal(), alibi()):
        kb.write_kernel(Kernel(name=p.name, family="fixture", ir_text=print_program(p), arch="any", dtype="fp32",
                               head_dim=0, verified=True, features_json=derive_features(p).to_json()))
    return kb


@pytest.mark.parametrize("score", ["", _SOFTCAP], ids=["causal", "softcap"])
def test_generate_end_to_end_and_verify(reference_kb, tmp_path: Path, score: str) -> None:
    spec = _spec(tmp_path, "dv_softcap" if score else "dv_causal", score=score)
    opts = GenerateOptions(out_dir=tmp_path / "out", verify_distributions=("normal",), verify_max_cases=1, backward=False,
                           compile_cuda=False)
    r = generate(reference_kb, spec, opts)
    assert r.succeeded, r.error + "\n" + "\n".join(f"{a.stage.value}: {a.feedback[:300]}" for a in r.attempts)
    assert "param v: [B, Hkv, N, Dv]" in r.files["ir"].read_text()
    res = verify(spec, r.files["candidate"], VerifyOptions(distributions=("normal", "adversarial"), max_cases=3))
    assert res.verdict.value == "passed", res.message
    assert {(c.D, c.Dv) for c in res.cases} == {(32, 64)} and len(res.cases) == 3


@pytest.mark.parametrize("score", ["", _SOFTCAP], ids=["causal", "softcap"])
def test_backward_for_value_heads_of_their_own_width(tmp_path: Path, score: str) -> None:
    """D_v != D_qk trains: the backward reference takes the value width for v, o, dO and dV (dP = dO V^T contracts
    over Dv, dQ and dK over D); the IR check passes and the lowered operator's gradients equal autograd's."""
    spec, fwd, bwd, _ = transferred_programs(_spec(tmp_path, "dv_bwd", score=score))
    assert {p.name: p.shape[-1] for p in bwd.params if p.name in ("v", "o", "dout", "dv", "dq", "dk")} == \
        {"v": "Dv", "o": "Dv", "dout": "Dv", "dv": "Dv", "dq": "D", "dk": "D"}
    assert check_backward_program(bwd, fwd, spec) is None
    mod, _ = load_module(lower_autograd(fwd, bwd), f"dv_bwd_{bool(score)}", tmp_path / "cache")
    torch.manual_seed(0)
    q, k = (torch.randn(1, 2, 40, 32, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 40, 64, requires_grad=True)
    out = mod.kb_attention(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    got = [t.grad for t in (q, k, v)]
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    s = ref[0] @ ref[1].transpose(-1, -2) / math.sqrt(32)
    if score:
        s = 20.0 * torch.tanh(s / 20.0)
    s = s.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    (s.softmax(-1) @ ref[2]).backward(dout)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r.grad, atol=2e-5, rtol=2e-5)
