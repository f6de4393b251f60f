"""Memory-augmented generation with the offline rule engine: spec -> verified kernel -> write-back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from generate.pipeline import GenerateOptions, generate
from generate.spec_cache import trace_key
from kb.ir.text import parse_program
from kb.settings import load_settings
from kb.store import open_kb
from kb.store.models import Attempt, GenerationRun, Kernel, Lesson
from tests.support.generate_fixtures import QUICK
from tests.support.repo import REPO

pytestmark = pytest.mark.network  # the session KB ingests the real flash-attn release

EXAMPLES = REPO / "examples" / "specs"
# quick verification in tests (one distribution, the spec's own shape); `kb generate` runs the full harness
RULE_SPECS = [
    "causal_d64.py", "causal_gqa_d128.py", "sliding_window.py", "alibi.py", "softcap_causal.py", "document_mask.py",
    "prefix_lm.py", "relative_bias.py", "mqa.py", "cross_attention.py", "sdpa_causal_d128_bf16.py",
    "chunked_prefill_bottom_right.py", "../../tests/data/specs/decode_mha.py",
]
# (examples/specs/decode_gqa_splitkv.py, bf16 with 2048 keys, takes minutes in the Triton interpreter;
#  the small split-KV decode spec above covers the same transfer)


@pytest.mark.parametrize("name", RULE_SPECS)
def test_rule_engine_generates_a_verified_kernel(ingested_kb, tmp_path: Path, name: str) -> None:
    r = generate(ingested_kb, EXAMPLES / name, GenerateOptions(out_dir=tmp_path / "out", **QUICK))
    assert r.succeeded, f"{name}: {r.error}\n" + "\n".join(f"{a.strategy}/{a.stage.value}: {a.verdict} {a.feedback[:200]}" for a in r.attempts)
    # the files a user gets
    for key in ("candidate", "triton", "ir", "report"):
        assert r.files[key].is_file(), key
    report = json.loads(r.files["report"].read_text())
    assert report["verify"]["verdict"] == "passed" and report["kernel_id"] == r.kernel_id
    cand = r.files["candidate"].read_text()
    assert "class ModelNew" in cand
    # the output keeps the inputs' dtype (no cast kernel after the attention: bf16 in, bf16 out)
    assert cand.rstrip().endswith("return _o")
    # write-back: the kernel, its lineage, the run and its attempts
    kernel = ingested_kb.get(r.kernel_id)
    assert isinstance(kernel, Kernel) and kernel.origin == "generated" and kernel.verified
    assert kernel.parent_id and ingested_kb.get(kernel.parent_id).origin in ("ingest", "generated")
    assert parse_program(kernel.ir_text).name.startswith("gen_")
    run = ingested_kb.get(r.run_id)
    assert isinstance(run, GenerationRun) and run.status == "succeeded" and run.kernel_id == r.kernel_id
    assert len(ingested_kb.list(Attempt, run_id=r.run_id)) == len(r.attempts)


def test_generated_cuda_source_compiles_with_nvcc(ingested_kb, tmp_path: Path) -> None:
    opts = GenerateOptions(out_dir=tmp_path / "out", **{**QUICK, "compile_cuda": True})
    r = generate(ingested_kb, EXAMPLES / "alibi.py", opts)
    assert r.succeeded, r.error
    report = json.loads(r.files["report"].read_text())
    assert r.files["cuda"].read_text().count("__global__") >= 1
    assert report["cuda"]["compiled"], report["cuda"]["log"]
    # which CUDA lowering wrote the .cu: the Hopper template (the default target is sm90), in bf16 since the spec was
    # traced in fp32 (its fp32 inputs keep the Triton kernels)
    assert report["cuda"]["lowering"] == "sm90_wgmma" and report["cuda"]["dtype"].startswith("bf16")
    assert "const __nv_bfloat16* q;" in r.files["cuda"].read_text()
    assert report["cuda"]["runs"].startswith("the Triton module runs: no `.cu`")  # never measured beside it
    # compiled before the write-back: the kernel's row records it
    assert ingested_kb.get(r.kernel_id).verify_note == "verify: passed; compile_cuda: ok"
    # the spec's trace is remembered: `kb query` of it later reads it instead of tracing (generate.spec_cache)
    entry = ingested_kb.settings.cache_dir / "spec-traces" / f"{trace_key(EXAMPLES / 'alibi.py')}.json"
    assert json.loads(entry.read_text())["score_mod"] is not None


def test_unexpressible_spec_is_a_recorded_failure(ingested_kb, tmp_path: Path) -> None:
    before = len(ingested_kb.list_kernels())
    r = generate(ingested_kb, REPO / "tests/data/specs_bad/op_after_softmax.py", GenerateOptions(out_dir=tmp_path))
    assert not r.succeeded and r.error
    run = ingested_kb.get(r.run_id)
    assert run.status == "failed" and run.error
    assert len(ingested_kb.list_kernels()) == before


def test_memory_makes_the_second_task_of_a_kind_cheaper(ingested_kb_settings, embedder, tmp_path: Path) -> None:
    """Two bottom-right (chunked-prefill) causal specs in a row.

    The nearest ingested reference is FA2's top-left causal Triton kernel, whose loop bounds
    are wrong for bottom-right masks, so without memory each spec pays a failed attempt.
    With memory the second spec starts from the first one's verified kernel (or its lesson)."""
    seq = [EXAMPLES / "chunked_prefill_bottom_right.py", REPO / "tests/data/specs/chunked_prefill_causal.py"]
    runs = {}
    for memory in (False, True):
        home = tmp_path / f"kb-{memory}"
        shutil.copytree(ingested_kb_settings.home, home)
        with open_kb(load_settings(home=home), embedder=embedder) as kb:
            runs[memory] = [generate(kb, s, GenerateOptions(memory=memory, out_dir=tmp_path / str(memory), **QUICK)) for s in seq]
            assert all(r.succeeded for r in runs[memory]), [r.error for r in runs[memory]]
            if memory:
                assert any(les.kind.startswith("strategy_") for les in kb.list(Lesson)), "lessons are written back"
    off, on = ([len(r.attempts) for r in runs[m]] for m in (False, True))
    assert on[0] == off[0], "the first task sees no memory either way"
    assert on[1] == 1, runs[True][1].attempts
    assert on[1] < off[1] or off[1] == 1, (on, off)
    assert off[0] > 1, "the top-ranked ingested reference is expected to fail first on bottom-right masks"
