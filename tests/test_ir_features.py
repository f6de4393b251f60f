"""Features derived from programs: variant kinds, split/decode, LSE, shapes, addressing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kb.features import Features
from kb.ir.expr import parse_expr as E
from kb.ir.features import derive_features
from kb.ir.nodes import Dtype, For, Full, Load, Param, Program, Role, Span
from kb.ir.text import parse_program, print_program
from tests.support.ir_programs import FIXTURES, alibi, causal, decode_split_kv, forward, plain, softcap

# name -> (mask kind, causal, sliding window, score kind, split_kv/decode)
EXPECTED = {
    "plain": ("none", False, False, "none", False),
    "causal": ("causal", True, False, "none", False),
    "sliding_window": ("sliding_window", True, True, "none", False),
    "alibi": ("causal", True, False, "alibi", False),
    "softcap": ("none", False, False, "softcap", False),
    "document": ("document", True, False, "none", False),
    "gqa": ("causal", True, False, "none", False),
    "decode_split_kv": ("none", False, False, "none", True),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_features(name: str) -> None:
    mask, is_causal, window, score, split = EXPECTED[name]
    for dtype in (Dtype.F32, Dtype.BF16):
        f = derive_features(FIXTURES[name](dtype=dtype))
        assert (f.mask, f.causal, f.sliding_window, f.score_mod) == (mask, is_causal, window, score)
        assert (f.split_kv, f.decode) == (split, split)
        assert f.dtype == {Dtype.F32: "fp32", Dtype.BF16: "bf16"}[dtype]
        assert f.return_lse and not (f.paged_kv or f.varlen or f.dropout or f.cross)
        assert f.alibi == (score == "alibi") and f.softcap == (score == "softcap")
        assert (f.gqa_ratio, f.head_dim, f.arch) == (1, 0, "any")  # generic program: any ratio, any head dim


def test_features_survive_the_text_form() -> None:
    for build in FIXTURES.values():
        p = build()
        assert derive_features(parse_program(print_program(p))) == derive_features(p)


def test_shapes_give_gqa_head_dim_decode_and_cross() -> None:
    g = derive_features(causal(), shapes=dict(B=2, Hq=8, Hkv=2, M=128, N=128, D=64), arch="sm90")
    assert (g.gqa_ratio, g.head_dim, g.decode, g.cross, g.arch) == (4, 64, False, False, "sm90")
    d = derive_features(plain(), shapes=dict(B=1, Hq=8, Hkv=1, M=1, N=4096, D=128))
    assert (d.gqa_ratio, d.decode, d.cross) == (8, True, False)
    assert not d.split_kv  # decode-shaped, but this program does not split the KV sequence
    c = derive_features(plain(), shapes=dict(B=1, Hq=4, Hkv=4, M=100, N=300, D=80))
    assert (c.cross, c.head_dim, c.gqa_ratio) == (True, 80, 1)


def test_head_dim_from_schedule_head_pad() -> None:
    p = replace(plain(), schedule=replace(plain().schedule, head_pad=128))
    assert derive_features(p).head_dim == 128


def test_specialised_program_gives_gqa_ratio_and_head_dim() -> None:
    fixed = {"Hq": 8, "Hkv": 2, "D": 64}
    params = tuple(replace(prm, shape=tuple(fixed.get(d, d) for d in prm.shape)) for prm in plain().params)
    f = derive_features(replace(plain(), params=params))
    assert (f.gqa_ratio, f.head_dim) == (4, 64)


def test_return_lse_needs_a_stored_lse_output() -> None:
    p = plain()
    k = p.kernels[0]
    no_lse = replace(p, params=tuple(prm for prm in p.params if prm.name != "lse"),
                     kernels=(replace(k, body=k.body[:-1]),))
    assert derive_features(no_lse).return_lse is False


def test_split_kv_from_the_grid_even_with_one_split() -> None:
    f = derive_features(decode_split_kv(num_splits=1))
    assert f.split_kv and not f.decode


def test_scalar_params_in_variants_are_probed() -> None:
    assert derive_features(softcap()).score_mod == "softcap"
    window = forward("w", mask_mod="(q_idx >= kv_idx) & (q_idx - kv_idx < window)", scalars=("window",))
    f = derive_features(window)
    assert f.mask == "sliding_window" and f.sliding_window and f.causal


def test_constant_and_custom_variants() -> None:
    const_cap = forward("c", score_mod="30.0 * tanh(score / 30.0)")
    assert derive_features(const_cap).softcap
    weird = forward("x", mask_mod="(q_idx * 7 + kv_idx) % 5 != 0")
    assert derive_features(weird).mask == "custom"


def _with_loads(p: Program, fn) -> Program:
    def block(stmts: tuple) -> tuple:
        return tuple(fn(st) if isinstance(st, Load) else replace(st, body=block(st.body)) if isinstance(st, For) else st
                     for st in stmts)
    return replace(p, kernels=tuple(replace(k, body=block(k.body)) for k in p.kernels))


def test_varlen_and_paged_kv_from_indirect_addressing() -> None:
    aux = (Param("cu_seqlens", ("B1",), Dtype.I32, Role.AUX), Param("page_table", ("B", "P"), Dtype.I32, Role.AUX))
    base = replace(plain(), params=plain().params + aux)

    def varlen(st: Load) -> Load:
        if st.tensor != "q":
            return st
        return replace(st, index=(E("0"), E("h"), Span(E("cu_seqlens[b] + m_start"), "BLOCK_M"), Full()))

    def paged(st: Load) -> Load:
        if st.tensor not in ("k", "v"):
            return st
        return replace(st, index=(E("b"), E("hk"), Span(E("page_table[b, n_start // 64] * 64"), "BLOCK_N"), Full()))

    f = derive_features(_with_loads(base, varlen))
    assert f.varlen and not f.paged_kv
    f = derive_features(_with_loads(base, paged))
    assert f.paged_kv and not f.varlen


def test_alibi_and_feature_json_round_trip() -> None:
    f = derive_features(alibi(Dtype.BF16))
    assert Features.from_json(f.to_json()) == f
    assert "alibi score_mod" in f.describe()
