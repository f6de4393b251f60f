"""Serving specs: paged-KV decode and packed varlen prefill trace into plain features plus
paged_kv / varlen, their reference is the user's Model on its own paged or packed inputs, and the
constructs not supported are named (generation: tests/test_generate_serving.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from generate.spec import load_spec
from kb.errors import KBError

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "tests/data/specs"
SERVING = REPO / "tests/data/specs_serving"


def test_paged_decode_reads_as_plain_decode_with_paged_kv() -> None:
    spec = load_spec(SPECS / "decode_paged_gqa.py")  # load_spec's self check ran the Model on paged inputs
    f = spec.features
    assert (f.mask, f.score_mod, f.decode, f.split_kv, f.paged_kv, f.varlen) == ("none", "none", True, True, True, False)
    assert (f.gqa_ratio, f.head_dim, f.dtype) == (4, 64, "bf16")
    assert spec.variants_text() == "mask_mod(b, h, q_idx, kv_idx) = kv_idx < seq_lens[b]"  # the bound is kept
    assert (spec.layout.kind, spec.layout.table, spec.layout.lengths) == ("paged", "block_table", "seq_lens")
    s = spec.shapes
    assert (s.B, s.Hq, s.Hkv, s.M, s.N, s.D) == (3, 8, 2, 1, 8 * 16, 64)  # N = MAX_PAGES * PAGE


def test_token_pool_decode_is_paged() -> None:
    spec = load_spec(SERVING / "decode_token_pool.py")
    assert (spec.layout.kind, spec.layout.table) == ("pool", "req_to_token")
    assert (spec.features.paged_kv, spec.features.decode, spec.features.mask, spec.features.gqa_ratio) == (True, True, "none", 4)
    assert spec.shapes.N == 96 and spec.shapes.dtype == "fp16"


def test_packed_varlen_reads_as_causal_varlen() -> None:
    spec = load_spec(SPECS / "varlen_prefill_causal.py")
    f = spec.features
    assert (f.mask, f.causal, f.varlen, f.paged_kv, f.decode, f.cross) == ("causal", True, True, False, False, False)
    assert (spec.layout.kind, spec.layout.table) == ("varlen", "cu_seqlens")
    assert "cu_seqlens_right_ids[q_idx] == cu_seqlens_right_ids[kv_idx]" in spec.variants_text()
    assert spec.derived_aux == {"cu_seqlens_right_ids": ("cu_seqlens", True)}
    assert (spec.shapes.B, spec.shapes.M, spec.shapes.N) == (1, 128, 128)  # the packed tokens as one row


@pytest.mark.parametrize("name,says,line", [
    ("varlen_loop", "a Python loop over sequences reading cu_seqlens values", "a, b = int(cu_seqlens[i])"),
    ("paged_index_select", "gathering k_cache with index_select: read a paged cache as k_cache[block_table]",
     "torch.index_select(k_cache, 0"),
])
def test_unsupported_serving_forms_are_named(name: str, says: str, line: str) -> None:
    with pytest.raises(KBError) as err:
        load_spec(SERVING / f"{name}.py")
    msg = str(err.value)
    assert says in msg and f"{name}.py:" in msg and line in msg and "\n" not in msg


def _variant(tmp_path: Path, src: Path, old: str, new: str) -> Path:
    text = src.read_text()
    assert old in text
    p = tmp_path / src.name
    p.write_text(text.replace(old, new))
    return p


def test_packed_tokens_without_unsqueeze_are_named(tmp_path: Path) -> None:
    p = _variant(tmp_path, SPECS / "varlen_prefill_causal.py", "qh = q.transpose(0, 1).unsqueeze(0)", "qh = q.transpose(0, 1)")
    with pytest.raises(KBError, match=r"q is a 3-D input .*q.transpose\(0, 1\).unsqueeze\(0\) for packed tokens"):
        load_spec(p)


def test_packed_tokens_without_block_diagonal_mask_are_refused(tmp_path: Path) -> None:
    p = _variant(tmp_path, SPECS / "varlen_prefill_causal.py", "visible = (seq[:, None] == seq[None, :]) & ", "visible = ")
    with pytest.raises(KBError, match="packed .* without a block-diagonal mask from cu_seqlens"):
        load_spec(p)


def test_page_table_listing_a_page_twice_is_refused(tmp_path: Path) -> None:
    p = _variant(tmp_path, SPECS / "decode_paged_gqa.py", ".reshape(B, MAX_PAGES).to(torch.int32)",
                 ".reshape(B, MAX_PAGES).to(torch.int32)\n    block_table[1, 0] = block_table[0, 0]")
    with pytest.raises(KBError, match="block_table maps two valid keys to one cache slot"):
        load_spec(p)


def test_a_wrong_page_read_fails_the_self_check(tmp_path: Path) -> None:
    # v read through k's cache: traced, but what the spec computes is not attention over its v
    p = _variant(tmp_path, SPECS / "decode_paged_gqa.py", "v = v_cache[block_table]", "v = k_cache[block_table]")
    with pytest.raises(KBError, match="k and v must both be read through one table|differs from what the spec computes"):
        load_spec(p)
