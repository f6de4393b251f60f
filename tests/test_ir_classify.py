"""Mask/score classification is semantic: syntactic variants of one mask get one class."""
import pytest

from kb.ir.classify import classify_mask, classify_score, features_from_variants, mask_kv_bounds
from kb.ir.expr import parse_expr as P, print_expr


@pytest.mark.parametrize("text", [
    "q_idx >= kv_idx", "kv_idx <= q_idx", "~(kv_idx > q_idx)", "kv_idx < q_idx + 1",
    "where(q_idx >= kv_idx, True, False)", "q_idx - kv_idx >= 0",
])
def test_causal_variants(text):
    mc = classify_mask(P(text))
    assert (mc.kind, mc.causal, mc.band_hi, mc.band_lo) == ("causal", True, 0, None)


@pytest.mark.parametrize("text", [
    "(q_idx >= kv_idx) & (q_idx - kv_idx < 16)", "(kv_idx <= q_idx) & (kv_idx > q_idx - 16)",
    "~((kv_idx > q_idx) | (q_idx - kv_idx >= 16))",
])
def test_sliding_window_variants(text):
    mc = classify_mask(P(text))
    assert (mc.kind, mc.causal, mc.window_left, mc.window_right) == ("sliding_window", True, 15, 0)


def test_symmetric_window_is_not_causal():
    mc = classify_mask(P("abs(q_idx - kv_idx) <= 8"))
    assert (mc.kind, mc.causal, mc.window_left, mc.window_right) == ("sliding_window", False, 8, 8)


def test_bottom_right_causal_symbolic_and_concrete():
    assert classify_mask(P("q_idx + (N - M) >= kv_idx")).bottom_right
    concrete = classify_mask(P("q_idx + 64 >= kv_idx"), dims=(64, 128))
    assert (concrete.kind, concrete.causal, concrete.bottom_right) == ("causal", True, True)
    # the same expression on a square problem is a window that looks ahead 64 keys, not causal
    assert classify_mask(P("q_idx + 64 >= kv_idx"), dims=(128, 128)).kind == "sliding_window"


def test_prefix_document_block_sparse_custom():
    assert classify_mask(P("(kv_idx < 10) | (q_idx >= kv_idx)")).prefix == 10
    assert classify_mask(P("(kv_idx < plen[b]) | (q_idx >= kv_idx)")).kind == "prefix_lm"
    doc = classify_mask(P("(doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)"))
    assert (doc.kind, doc.causal, doc.tensors) == ("document", True, ("doc",))
    assert classify_mask(P("layout[h, q_idx // 16, kv_idx // 16]")).kind == "block_sparse"
    assert classify_mask(P("q_idx % 2 == 0")).kind == "custom"
    assert classify_mask(None).kind == "none"
    assert classify_mask(P("kv_idx <= q_idx + 127"), dims=(1, 128)).kind == "none"  # decode: every key visible


def test_kv_bounds():
    lo, hi = mask_kv_bounds(P("q_idx >= kv_idx"))
    assert (print_expr(lo), print_expr(hi)) == ("0", "minimum(N, m_start + BLOCK_M)")
    lo, hi = mask_kv_bounds(P("(q_idx >= kv_idx) & (q_idx - kv_idx < 16)"))
    assert print_expr(lo) == "maximum(0, m_start - 15)"
    lo, hi = mask_kv_bounds(P("q_idx + 64 >= kv_idx"), dims=(64, 128))
    assert print_expr(hi) == "minimum(N, m_start + BLOCK_M + (N - M))"
    assert mask_kv_bounds(P("(kv_idx < 10) | (q_idx >= kv_idx)")) is None
    assert mask_kv_bounds(None) is None


@pytest.mark.parametrize("text,kind", [
    ("score", "none"),
    ("score + slopes[h] * (kv_idx - q_idx)", "alibi"),
    ("score - slopes[h] * abs(q_idx - kv_idx)", "alibi"),
    ("score + exp2(-(h + 1) * 0.5) * (kv_idx - q_idx)", "alibi"),
    ("50.0 * tanh(score / 50.0)", "softcap"),
    ("tanh(score * 0.02) * 50.0", "softcap"),
    ("score + bias[h, q_idx - kv_idx + 63]", "relative_bias"),
    ("score + table[h, q_idx, kv_idx]", "bias_table"),
    ("score * 2.0", "custom"),
    ("score * temp[h] + sigmoid(score)", "custom"),
])
def test_score_kinds(text, kind):
    assert classify_score(P(text)).kind == kind


def test_softcap_value_and_combination():
    sc = classify_score(P("30.0 * tanh((score + slopes[h] * (kv_idx - q_idx)) / 30.0)"))
    assert (sc.kind, sc.alibi, sc.softcap) == ("alibi", True, 30.0)


def test_features_from_variants():
    f = features_from_variants(P("tanh(score / 50.0) * 50.0"), P("q_idx >= kv_idx"), head_dim=128, dtype="bf16",
                               gqa_ratio=2, seq_q=256, seq_kv=256)
    assert (f.mask, f.causal, f.score_mod, f.softcap, f.gqa_ratio, f.decode, f.cross) == \
        ("causal", True, "softcap", True, 2, False, False)
    d = features_from_variants(None, None, head_dim=64, dtype="fp16", seq_q=1, seq_kv=4096)
    assert (d.decode, d.split_kv, d.cross) == (True, True, False)
    c = features_from_variants(None, None, head_dim=64, dtype="fp16", seq_q=100, seq_kv=300)
    assert (c.decode, c.cross) == (False, True)
