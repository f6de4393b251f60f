"""Retrieval: filters, structural ranking, explained scores, the weight table, `kb query`.

A tiny KB of real IR programs (tests/support/ir_programs.py, printed by the IR printer, features
derived from the programs) with the real embedding model.
"""

from __future__ import annotations

import functools
import json
import os
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from kb.features import Features
from kb.ir.features import derive_features
from kb.ir.nodes import Dtype
from kb.ir.text import print_program
from kb.settings import load_settings
from kb.store import Kernel, KernelBundle, Snippet, open_kb
from retrieve.families import FAMILY_TABLE, label_family
from retrieve.hybrid import Filters, query
from retrieve.structural import TERMS, WEIGHTS_PATH, load_weights
from tests.support import ir_programs

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "tests/data/specs"
runner = CliRunner()

# fixture name -> (arch, dtype, head dim); every fixture has distinct features except gqa (== causal)
ROWS = {
    "plain": ("sm80", Dtype.F32, 64),
    "causal": ("sm90", Dtype.BF16, 128),
    "sliding_window": ("any", Dtype.BF16, 128),
    "alibi": ("sm80", Dtype.F16, 64),
    "softcap": ("sm90", Dtype.F32, 128),
    "document": ("sm100", Dtype.BF16, 64),
    "decode_split_kv": ("any", Dtype.F32, 128),
}


@functools.cache
def _program(name: str) -> tuple[str, str]:
    """(IR text, features JSON) of a fixture program at its row's arch, dtype and head dim."""
    arch, dtype, hd = ROWS[name]
    prog = ir_programs.FIXTURES[name](dtype=dtype)
    return print_program(prog), derive_features(prog, arch=arch, shapes={"D": hd}).to_json()


def _kernel(name: str, *, origin: str = "ingest", family: str = "fa2_triton", suffix: str = "") -> Kernel:
    arch, _, hd = ROWS[name]
    ir, feats = _program(name)
    return Kernel(name=name + suffix, family=family, origin=origin, ir_text=ir + ("\n" if suffix else ""), features_json=feats,
                  arch=arch, dtype=Features.from_json(feats).dtype, head_dim=hd, verified=True)


@pytest.fixture(scope="module")
def small_kb(tmp_path_factory: pytest.TempPathFactory, embedder):
    """One KB for the module (queries never write): the fixtures, a generated kernel, a snippet-only row."""
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("KB_")]:
            mp.delenv(name)
        settings = load_settings(home=tmp_path_factory.mktemp("retrieve") / "kb")
    gen = _kernel("causal", origin="generated", family="generated", suffix="_gen")
    snip = Kernel(name="mask_region", family="fa2_cuda", ir_text="snippets: mask_causal",
                  features_json=Features(mask="causal", causal=True).to_json(), arch="sm80")
    snippets = [Snippet(kind="mask_causal", title="causal mask", ir_text="mask_mod = q_idx >= kv_idx"),
                Snippet(kind="mask_local", title="sliding window mask",
                        ir_text="mask_mod = (q_idx >= kv_idx) & (q_idx - kv_idx < W)")]
    with open_kb(settings, embedder=embedder) as store:
        store.write_kernels([KernelBundle(_kernel(n)) for n in ROWS]
                            + [KernelBundle(gen), KernelBundle(snip, snippets=snippets)])
        yield store


def _names(kb, **flt) -> set[str]:
    res = query(kb, "attention kernel", Features(), k=100, filters=Filters(**flt))
    return {r.name for r in res.kernels}


def test_filters_return_only_matching_kernels(small_kb) -> None:
    everything = set(ROWS) | {"causal_gen"}
    assert _names(small_kb) == everything  # programs only: the snippet-only row is never a candidate
    assert "mask_region" in _names(small_kb, programs_only=False)
    assert _names(small_kb, arch="sm90") == {"causal", "causal_gen", "softcap", "sliding_window", "decode_split_kv"}
    assert _names(small_kb, dtype="bf16") == {"causal", "causal_gen", "sliding_window", "document"}
    assert _names(small_kb, head_dim=64) == {"plain", "alibi", "document"}
    assert _names(small_kb, decode=True) == {"decode_split_kv"}
    assert _names(small_kb, decode=False) == everything - {"decode_split_kv"}
    assert _names(small_kb, memory=False) == set(ROWS)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_structural_ranking_puts_exact_feature_kernel_first(small_kb, name: str) -> None:
    target = Features.from_json(_kernel(name).features_json)
    res = query(small_kb, "", target, k=3, mode="structural", filters=Filters(memory=False))
    assert res.kernels[0].name == name
    assert res.kernels[0].score > res.kernels[1].score


@pytest.mark.parametrize("mode", ["hybrid", "embedding", "structural"])
def test_explanation_terms_sum_to_score(small_kb, mode: str) -> None:
    target = Features.from_json(_kernel("softcap").features_json)
    res = query(small_kb, target.describe(), target, k=10, mode=mode)
    assert len(res.kernels) == len(ROWS) + 1
    for r in res.kernels:
        assert r.score == pytest.approx(sum(r.terms.values()))
        if mode == "embedding":
            assert set(r.terms) == {"embedding"}
        if mode == "structural":
            assert "embedding" not in r.terms
    assert [r.score for r in res.kernels] == sorted((r.score for r in res.kernels), reverse=True)


def test_embedding_mode_finds_the_described_kernel(small_kb) -> None:
    res = query(small_kb, "split kv decode with combine of partial results by lse", None, k=2, mode="embedding")
    assert res.kernels[0].name == "decode_split_kv"


def test_weight_table_covers_every_term() -> None:
    w = load_weights()
    assert set(TERMS) <= set(w) and {"embedding", "perf"} <= set(w)
    if WEIGHTS_PATH.is_file():  # the fitted table says where it came from
        data = json.loads(WEIGHTS_PATH.read_text())
        assert {"fitted", "pairs", "specs", "cv"} <= set(data)


def test_label_family_table_covers_every_corpus_family() -> None:
    families = {t["family"] for path in (REPO / "corpus").glob("*.toml")
                for t in tomllib.loads(path.read_text()).get("files", []) if "family" in t}
    assert families and families <= set(FAMILY_TABLE)
    assert label_family("fa2_triton_amd", Features(split_kv=True, decode=True)) == "triton_decode"
    assert label_family("fa2_triton", Features()) == "triton_fwd"
    assert label_family("cutlass_fmha_sm90", Features()) == "cutlass_fmha"


def _cli(kb, *args: str):
    return runner.invoke(app, ["--home", str(kb.settings.home), "query", *args])


def test_cli_query_spec_file_prints_table(small_kb) -> None:
    res = _cli(small_kb, str(SPECS / "sliding_window_32.py"), "-k", "3")
    assert res.exit_code == 0, res.output
    assert "top 3 kernels (hybrid)" in res.output and "sliding_window" in res.output
    assert "snippets a transfer needs" in res.output and "sliding window mask" in res.output


def test_cli_query_free_text_json(small_kb) -> None:
    res = _cli(small_kb, "causal mask with alibi slopes", "--json", "-k", "4", "--mode", "embedding")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["target"] is None and len(data["kernels"]) == 4
    for row in data["kernels"]:
        assert row["score"] == pytest.approx(sum(row["terms"].values()))
    text = _cli(small_kb, "causal mask with alibi slopes")
    assert text.exit_code == 0 and "top 5 kernels (hybrid)" in text.output


def test_cli_bad_mode_is_a_clean_error(small_kb) -> None:
    res = _cli(small_kb, "causal", "--mode", "fancy")
    assert res.exit_code == 1
    assert "unknown --mode 'fancy'" in res.output
    assert "Traceback" not in res.output
