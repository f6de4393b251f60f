"""Serving-layout calls (verify.serving_cases): a paged kernel that assumes its pages in order, or no empty sequence,
passes the spec's own inputs and fails there; an honest one passes; the varlen re-split keeps what a caller relies on."""

from __future__ import annotations

import torch

from tests.support.repo import REPO
from verify import Verdict, VerifyOptions, verify
from verify.load import load_spec
from verify.serving_cases import REPAGED_SIZES, serving_variants

FIX = REPO / "tests" / "support" / "verify_fixtures"
PAGED = {"kind": "paged", "q": "q", "k": "k_cache", "v": "v_cache", "table": "block_table", "lengths": "seq_lens",
         "table_k": None, "q_offsets": None}
OPTS = dict(torch_baseline=True, distributions=("normal",), max_cases=1, timeout_s=300)


def test_paged_variants_move_share_and_empty_pages() -> None:
    spec = load_spec(FIX / "paged_spec.py")
    own = spec.get_inputs()
    (moved_what, moved), *repaged, (ragged_what, ragged) = serving_variants(spec.model_cls, own, PAGED, seed=3)
    assert "shared" in moved_what and "empty" in ragged_what
    model = spec.model_cls()
    for (what, x), page in zip(repaged, REPAGED_SIZES, strict=True):  # the same sequences, other page sizes
        assert f"re-paged at {page} token" in what and x[1].shape[1] == page and x[3].shape[1] * page >= 20
        assert torch.allclose(model(*x), model(*own), atol=1e-6)
    q, k, v, table, lens = moved
    assert not torch.equal(table, own[3]) and torch.equal(table[1, :1], table[0, :1])  # a shared first page
    for b in (0, 2):  # an unshared sequence reads the same keys from their new pages
        n = int(lens[b])
        rows = table[b, torch.arange(n) // 4].long() * 4 + torch.arange(n) % 4
        old = own[3][b, torch.arange(n) // 4].long() * 4 + torch.arange(n) % 4
        assert torch.equal(k.flatten(0, 1)[rows], own[1].flatten(0, 1)[old])
    assert sorted(ragged[4].tolist())[:2] == [0, 1] and 20 in ragged[4].tolist()


def test_varlen_resplit_keeps_total_and_longest_and_moves_every_copy_of_the_offsets() -> None:
    spec = load_spec(REPO / "tests" / "data" / "specs_serving" / "varlen_sinks.py")
    own = spec.get_inputs()
    layout = {"kind": "varlen", "q": "q", "k": "k", "v": "v", "table": "cu_seqlens_q", "lengths": None}
    ((what, new),) = serving_variants(spec.model_cls, own, layout, seed=1)
    lens = (new[3][1:] - new[3][:-1]).tolist()
    assert "re-split" in what and int(new[3][-1]) == int(own[3][-1]) and max(lens) == max(own[5], 0)
    assert 0 in lens and 1 in lens and len(lens) == len(own[3]) - 1
    assert torch.equal(new[4], new[3]) and new[4] is not new[3]  # cu_seqlens_k held the same offsets: it follows


def test_a_kernel_assuming_pages_in_order_or_no_empty_sequence_fails_and_an_honest_one_passes() -> None:
    opts = VerifyOptions(serving=PAGED, **OPTS)
    honest = verify(FIX / "paged_spec.py", FIX / "paged_torch.py", opts)
    assert honest.verdict is Verdict.passed, honest.message
    assert sum("serving layout checked" in n for n in honest.notes) == 4 and "pages moved" in honest.message
    for cheat, step in (("paged_contiguous.py", "pages moved"), ("paged_nonempty.py", "lengths redrawn"),
                        ("paged_fixed_page.py", "re-paged at 1 token")):
        r = verify(FIX / "paged_spec.py", FIX / cheat, opts)
        assert r.verdict is Verdict.numeric_mismatch and step in r.message, (cheat, r.message)
    # without the layout's calls the spec's own inputs do not catch them
    assert verify(FIX / "paged_spec.py", FIX / "paged_contiguous.py", VerifyOptions(**OPTS)).verdict is Verdict.passed
