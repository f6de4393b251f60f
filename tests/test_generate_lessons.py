"""Lessons are about kernels: an unreachable LLM, a harness timeout or a spec the pipeline
refuses writes no lesson (a lesson pushes a strategy later for every spec with the same features)."""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import pytest

from generate.attempts import AttemptOutcome, Cause
from generate.lessons import lessons_for_run
from generate.pipeline import GenerateOptions, generate
from generate.spec import load_spec
from generate.stages import Stage
from kb.store import open_kb
from kb.store.models import Attempt, Lesson
from tests.support.repo import REPO
from verify.result import Verdict

pytestmark = pytest.mark.network  # the session KB ingests the real flash-attn release

SPEC = REPO / "examples" / "specs" / "causal_d64.py"


def _closed_port() -> int:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refused_llm_connection_writes_no_lesson(ingested_kb_settings, embedder, tmp_path: Path) -> None:
    settings = replace(ingested_kb_settings, llm_base_url=f"http://127.0.0.1:{_closed_port()}/v1", llm_model="m",
                       llm_timeout_s=2.0)
    with open_kb(settings, embedder=embedder) as kb:
        r = generate(kb, SPEC, GenerateOptions(engine="llm", out_dir=tmp_path / "out"))
        assert not r.succeeded and "cannot connect to the LLM server" in r.error
        assert [a.cause for a in r.attempts] == [Cause.ENVIRONMENT]
        assert len(kb.list(Attempt, run_id=r.run_id)) == 1  # the attempt is kept as a record
        assert kb.list(Lesson, run_id=r.run_id) == []


def test_spec_error_writes_no_lesson(ingested_kb, tmp_path: Path) -> None:
    """A random tensor that no state_dict carries: refused by name before any attempt."""
    r = generate(ingested_kb, REPO / "tests/data/specs_state/random_attribute.py", GenerateOptions(out_dir=tmp_path, backward=False))
    assert not r.succeeded and "bias" in r.error and "register_buffer" in r.error
    assert r.attempts == ()
    assert ingested_kb.list(Lesson, run_id=r.run_id) == []


def _outcome(n: int, strategy: str, verdict: str, feedback: str = "", cause: Cause = Cause.KERNEL) -> AttemptOutcome:
    return AttemptOutcome(n, "k-ref", strategy, Stage.VERIFY, Verdict(verdict), feedback, 1.0, "", cause)


def test_only_kernel_failures_become_lessons() -> None:
    spec = load_spec(SPEC)
    outcomes = [
        _outcome(1, "reuse", "timeout", "no result within 300s (in flight: ...)"),
        _outcome(2, "derive", "runtime_error", "candidate process killed by SIGKILL (memory limit 8192 MiB)"),
        _outcome(3, "llm", "runtime_error", "cannot connect", Cause.ENVIRONMENT),
        _outcome(4, "block_mask", "numeric_mismatch", "12 elements out of tolerance"),
        _outcome(5, "reuse", "passed"),
    ]
    kinds = [les.kind for les in lessons_for_run("run-1", spec, outcomes, succeeded=True)]
    assert kinds == ["strategy_failed:block_mask", "strategy_succeeded:reuse"]
