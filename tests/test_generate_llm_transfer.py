"""The LLM engine inside `generate`, against a real OpenAI-compatible HTTP server on 127.0.0.1."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import generate.pipeline as pipeline
from generate.pipeline import GenerateOptions, generate
from generate.spec import load_spec
from generate.target import target_for
from generate.transfer import Strategy, transfer
from kb.features import Features
from kb.ir.text import parse_program, print_program
from kb.settings import load_settings
from kb.store import open_kb
from kb.store.models import Attempt, GenerationRun
from tests.support.fake_llm_server import answer, delayed, http_error
from tests.support.fixtures_llm import fake_llm  # noqa: F401
from tests.support.repo import REPO

pytestmark = pytest.mark.network

SPEC = REPO / "examples/specs/causal_d64.py"
QUICK = dict(verify_distributions=("normal",), verify_max_cases=1, backward=False)


@pytest.fixture
def llm_kb(ingested_home: Path, fake_llm, tmp_path: Path, embedder):
    home = tmp_path / "kb"
    shutil.copytree(ingested_home, home)
    settings = replace(load_settings(home=home), llm_base_url=fake_llm.base_url, llm_model=fake_llm.model,
                       llm_timeout_s=2.0, llm_max_attempts=3)
    with open_kb(settings, embedder=embedder) as kb:
        yield kb


def _programs(kb) -> tuple[str, str]:
    """(a correct answer, a numerically wrong one) for SPEC, built from an ingested reference."""
    spec = load_spec(SPEC)

    ref = next(k for k in kb.list_kernels(origin="ingest")
               if k.ir_text.startswith("program ") and not Features.from_json(k.features_json).split_kv
               and not Features.from_json(k.features_json).backward)
    good = transfer(parse_program(ref.ir_text), target_for(spec), Strategy.BLOCK_MASK, name="llm_causal")
    wrong = replace(good, mask_mod=None, kernels=transfer(parse_program(ref.ir_text), replace(target_for(spec), mask_mod=None),
                                                          Strategy.BLOCK_MASK).kernels)
    return print_program(good), print_program(wrong)


def test_llm_repairs_from_feedback_and_writes_back(llm_kb, fake_llm, tmp_path: Path) -> None:
    good, wrong = _programs(llm_kb)
    fake_llm.script(answer("I think the kernel is fine."), answer(f"```kbir\n{wrong}\n```"), answer(f"```kbir\n{good}\n```"))
    r = generate(llm_kb, SPEC, GenerateOptions(engine="llm", out_dir=tmp_path / "out", **QUICK))
    assert r.succeeded, r.error
    assert [a.verdict for a in r.attempts] == ["compile_error", "numeric_mismatch", "passed"]
    # each failure went back to the model as feedback, in one conversation
    assert len(fake_llm.requests) == 3
    second, third = (req["messages"][-1]["content"] for req in fake_llm.requests[1:])
    assert "line" in second and "IR output differs" in third
    run = llm_kb.get(r.run_id)
    assert run.status == "succeeded" and run.engine == "llm"
    assert len(llm_kb.list(Attempt, run_id=r.run_id)) == 3
    assert llm_kb.get(r.kernel_id).parent_id


def test_what_an_llm_program_raises_is_a_failed_attempt(llm_kb, fake_llm, tmp_path: Path, monkeypatch) -> None:
    good, _ = _programs(llm_kb)
    real, calls = pipeline.check_program, []

    def breaks_once(program, spec):
        calls.append(program)
        if len(calls) == 1:
            raise RuntimeError("shape mismatch in dot")
        return real(program, spec)

    monkeypatch.setattr(pipeline, "check_program", breaks_once)
    fake_llm.script(answer(f"```kbir\n{good}\n```"), answer(f"```kbir\n{good}\n```"))
    r = generate(llm_kb, SPEC, GenerateOptions(engine="llm", out_dir=tmp_path / "out", **QUICK))
    assert r.succeeded, r.error
    first = r.attempts[0]
    assert (first.stage.value, first.verdict) == ("ir_check", "runtime_error")
    assert "RuntimeError: shape mismatch in dot" in first.feedback
    assert "[check error] running the program raised RuntimeError" in fake_llm.requests[1]["messages"][-1]["content"]


@pytest.mark.parametrize("reply,needle", [(http_error(500, "model overloaded"), "overloaded"),
                                           (delayed(5.0, "late"), "did not answer")])
def test_llm_service_failure_is_a_recorded_failed_run(llm_kb, fake_llm, tmp_path: Path, reply, needle: str) -> None:
    kernels_before = len(llm_kb.list_kernels())
    fake_llm.script(reply)
    r = generate(llm_kb, SPEC, GenerateOptions(engine="llm", out_dir=tmp_path / "out", **QUICK))
    assert not r.succeeded and needle in r.error.lower()
    run = llm_kb.get(r.run_id)
    assert isinstance(run, GenerationRun) and run.status == "failed" and needle in run.error.lower()
    assert len(llm_kb.list_kernels()) == kernels_before  # nothing half-written
    assert llm_kb.doctor().ok


def test_llm_engine_without_settings_says_what_to_set(ingested_home: Path, tmp_path: Path, embedder) -> None:
    home = tmp_path / "kb"
    shutil.copytree(ingested_home, home)
    with open_kb(load_settings(home=home), embedder=embedder) as kb:
        r = generate(kb, SPEC, GenerateOptions(engine="llm", out_dir=tmp_path / "out"))
    assert not r.succeeded and "KB_LLM_BASE_URL" in r.error
