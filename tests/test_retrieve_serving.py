"""Retrieval for serving specs against the real KB of `kb ingest --all` (vLLM and SGLang sources
included): a packed varlen spec gets the serving varlen prefill programs (SGLang's, vLLM's) first, a paged decode spec a paged
decode program when the KB has one (else a split-KV decode program)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from generate.spec import load_spec
from cli.main import app
from retrieve.families import label_family
from retrieve.hybrid import Filters, describe_target, query

SPECS = Path(__file__).resolve().parents[1] / "tests/data/specs"
EVAL = Filters(programs_only=True, memory=False)  # as bench/eval_retrieval.py ranks


def _ranked(kb, name: str):
    spec = load_spec(SPECS / name)
    return query(kb, describe_target(spec.features, *spec.variant_strings()), spec.features, k=50, filters=EVAL,
                 mode="hybrid").kernels


def test_varlen_spec_ranks_the_serving_varlen_prefill_programs_first(ingested_kb) -> None:
    ranked = _ranked(ingested_kb, "varlen_prefill_causal.py")
    varlen_causal = [r for r in ranked if r.features.varlen and r.features.causal]
    families = {r.family for r in varlen_causal}
    assert "sglang_triton" in families  # SGLang's packed prefill (and vLLM's, once lifted: main since 5dd5a6a)
    top = ranked[:len(varlen_causal)]
    assert top == varlen_causal, [(r.name, round(r.score, 2)) for r in ranked[:len(varlen_causal) + 2]]
    assert all(label_family(r.family, r.features) == "serving_triton" and r.terms["varlen_same"] > 0 for r in top)
    # a non-causal serving varlen program is still the first non-causal program
    plain = [r for r in ranked if not r.features.causal]
    assert plain[0].features.varlen and label_family(plain[0].family, plain[0].features) == "serving_triton"


def test_paged_decode_spec_ranks_the_serving_paged_decode_programs_first(ingested_kb) -> None:
    ranked = _ranked(ingested_kb, "decode_paged_gqa.py")
    paged = [r for r in ranked if r.features.paged_kv and r.features.decode]
    assert {r.family for r in paged} >= {"sglang_triton", "vllm_triton"}  # both split decodes lifted
    top = ranked[:len(paged)]
    assert top == paged, [(r.name, round(r.score, 2)) for r in ranked[:len(paged) + 2]]
    assert all(label_family(r.family, r.features) == "serving_triton" and r.terms["paged_same"] > 0 for r in top)


def test_kb_query_explains_a_serving_spec(ingested_kb_settings) -> None:
    res = CliRunner().invoke(app, ["--home", str(ingested_kb_settings.home), "query", str(SPECS / "varlen_prefill_causal.py"),
                                   "-k", "3", "--json", "--no-memory"])
    assert res.exit_code == 0, res.output
    assert '"varlen": true' in res.output and '"varlen_same"' in res.output and "sglang_triton" in res.output
