"""A generation run stopped half-way leaves a recorded run, no half-written kernel and no process.

Ctrl-C and SIGTERM record the run as `interrupted` and say so on one line; SIGKILL leaves the run
`running` and the verify temp dir behind until `kb doctor --fix` sees that their process is gone.
Either way the verify child is gone with `kb`. The spec's budget (--timeout) bounds all its attempts.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from generate import pipeline
from generate.pipeline import GenerateOptions, generate
from tests.support.repo import KB_CLI, REPO
from tests.support.procs import group_ends, kb_env, proc_table, sigint_default, verify_dirs, wait_for
from verify.result import Verdict

pytestmark = pytest.mark.network
SPEC = REPO / "examples/specs/alibi.py"


def _rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return con.execute(sql).fetchall()


def _doctor(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KB_CLI, "doctor", "--json", *flags], env=env, cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_stopped_generate_leaves_no_half_written_kernel_and_no_process(ingested_home: Path, tmp_path: Path, sig: int) -> None:
    shutil.copytree(ingested_home, tmp_path / "kb")
    db = tmp_path / "kb" / "kb.sqlite"
    kernels_before = _rows(db, "select count(*) from kernels")[0][0]
    env = kb_env(tmp_path)
    proc = subprocess.Popen([*KB_CLI, "generate", str(SPEC), "--out", str(tmp_path / "out")], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=sigint_default)
    child = wait_for(lambda: [r for r in proc_table() if r[1] == proc.pid and "verify.child" in r[4]], 300, proc)
    pgid = child[0][2]  # type: ignore[index]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert group_ends(pgid), "the verify child (or what it started) outlived kb generate"
    assert _rows(db, "select count(*) from kernels")[0][0] == kernels_before  # no kernel without its run and checks
    (run_id, status, error), = _rows(db, "select id, status, error from generation_runs")
    if sig != signal.SIGKILL:
        assert proc.returncode == 128 + sig, err.decode()[-2000:]
        assert err.decode().splitlines()[-1] == f"kb: interrupted: run {run_id} recorded as interrupted; no kernel written"
        assert status == "interrupted" and "interrupted" in error
        assert verify_dirs(tmp_path) == []
        assert _doctor(env).returncode == 0
        return
    # SIGKILL runs no handler: the run stays `running` (with its owner) and the temp dir stays, until kb doctor
    assert status == "running" and f"pid={proc.pid}" in error
    left = verify_dirs(tmp_path)
    assert len(left) == 1
    found = _doctor(env)
    assert found.returncode == 1
    assert {(i["kind"], i["id"]) for i in json.loads(found.stdout)["issues"]} == {("stuck_run", run_id),
                                                                                   ("orphan_temp_dir", str(left[0]))}
    assert _doctor(env, "--fix").returncode == 0
    (status, error), = _rows(db, "select status, error from generation_runs")
    assert status == "interrupted" and f"pid {proc.pid}" in error
    assert verify_dirs(tmp_path) == [] and _doctor(env).returncode == 0


def test_one_budget_bounds_all_attempts_of_a_spec(ingested_kb, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec's --timeout is shared: once an attempt has spent it, no further attempt starts, and the run says so.
    The verifier is stood in for by one that spends the whole budget (a real 1 s budget could run out while tracing
    the spec on a loaded machine, before any attempt)."""
    spent: list[bool] = []

    def verify_spending_the_budget(spec, candidate, options, *, backward=False):
        spent.append(True)
        return Verdict.timeout, "timed out: the verifier used the spec's whole budget"

    budget_left = pipeline._budget_left
    monkeypatch.setattr(pipeline, "_verify", verify_spending_the_budget)
    monkeypatch.setattr(pipeline, "_budget_left", lambda options: 0.0 if spent else budget_left(options))
    res = generate(ingested_kb, SPEC, GenerateOptions(out_dir=tmp_path / "out", timeout_s=120.0, compile_cuda=False))
    assert not res.succeeded and len(spent) == 1 and res.attempts[-1].verdict == "timeout"
    assert "budget of 120s (--timeout) is spent: no further attempt started" in res.error
    assert ingested_kb.get(res.run_id).status == "failed"
