"""A stopped `kb verify` leaves no process and no temp directory behind, however it is stopped.

Real processes and real signals: the `kb` console script runs a candidate whose forward starts a
worker process and never returns; the test waits until that worker runs (so the child is deep in
the candidate), signals `kb`, and then scans /proc for anything left in the child's process group.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from kb.errors import KBError
from kb.procs import Owner, start_ticks
from kb.settings import load_settings
from kb.store.doctor import DriftKind, run_doctor
from tests.support.procs import group_ends, kb_env, live_in_group, proc_table, sigint_default, verify_dirs, wait_for
from tests.support.repo import KB_CLI
from verify import VerifyOptions, verify

FIX = Path(__file__).parent / "support" / "verify_fixtures"
SPEC = FIX / "attn_spec.py"
HANGS_WITH_WORKER = FIX / "hangs_with_worker.py"


def _hanging_candidate(tmp_path: Path) -> tuple[Path, str]:
    """The hanging candidate copied into a directory whose unique name its worker's command line ends with."""
    marker = f"hang-{uuid.uuid4().hex}"
    (tmp_path / marker).mkdir()
    return Path(shutil.copy(HANGS_WITH_WORKER, tmp_path / marker)), marker


# ---- kb verify stopped by each signal

def _start_hanging_verify(tmp_path: Path) -> tuple[subprocess.Popen, int, int]:
    """`kb verify` on the hanging candidate; returns (kb, child pid, child's process group) once the worker runs."""
    candidate, marker = _hanging_candidate(tmp_path)
    proc = subprocess.Popen([*KB_CLI, "verify", str(SPEC), str(candidate), "--timeout", "300"],
                            env=kb_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=sigint_default)
    worker = wait_for(lambda: [r for r in proc_table() if r[4].endswith(marker + " ") and "-c" in r[4]], 120, proc)
    _, child, pgid, _, _ = worker[0]  # type: ignore[index]
    assert pgid == child and next(r[1] for r in proc_table() if r[0] == child) == proc.pid
    return proc, child, pgid


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stopped_verify_kills_the_candidate_and_says_so(tmp_path: Path, sig: int) -> None:
    proc, child, pgid = _start_hanging_verify(tmp_path)
    assert verify_dirs(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig  # 130 for Ctrl-C, 143 for SIGTERM
    lines = [x for x in err.decode().splitlines() if not x.startswith("WARNING verify.sandbox:")]  # a machine lacking a layer
    assert lines == ["kb: interrupted: verification stopped; no candidate process or temp directory left, no report written"]
    assert group_ends(pgid, 5.0), f"outlived kb verify: {live_in_group(pgid)}"
    assert verify_dirs(tmp_path) == []


class _Stop(Exception):
    pass


def test_an_exception_in_verify_kills_the_child_while_the_caller_lives_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's `finally`, alone: this process stays alive, so PDEATHSIG cannot be what kills the child."""
    candidate, marker = _hanging_candidate(tmp_path)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    found: list[tuple] = []

    def watch(main: int) -> None:  # once the worker runs, interrupt the main thread inside the runner's wait
        deadline = time.monotonic() + 120
        while not found and time.monotonic() < deadline:
            found.extend(r for r in proc_table() if r[4].endswith(marker + " "))
            time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGUSR1)

    def stop(signum: int, frame: object) -> None:
        raise _Stop

    old = signal.signal(signal.SIGUSR1, stop)
    try:
        threading.Thread(target=watch, args=(threading.get_ident(),), daemon=True).start()
        with pytest.raises(_Stop):
            verify(SPEC, candidate, VerifyOptions(distributions=("normal",), max_cases=1, timeout_s=300))
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert found, "the worker never started"
    assert not live_in_group(found[0][2]), "the runner returned with its candidate still running"
    assert verify_dirs(tmp_path) == []


def test_sigkilled_verify_takes_the_candidate_with_it(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """SIGKILL runs no `finally`: PR_SET_PDEATHSIG kills the child, the child's reaper kills its worker;
    the temp dir stays until `kb doctor --fix` sees its owner is gone."""
    proc, child, pgid = _start_hanging_verify(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert group_ends(pgid), f"left running after kb was SIGKILLed: {live_in_group(pgid)}"
    left = verify_dirs(tmp_path)
    assert len(left) == 1 and left[0].name.startswith(f"kb-verify-{proc.pid}-")
    kb = request.getfixturevalue("kb")
    found = run_doctor(kb, temp_root=tmp_path / "tmp")
    assert [(d.kind, d.id) for d in found.issues] == [(DriftKind.ORPHAN_TEMP_DIR, str(left[0]))]
    assert run_doctor(kb, fix=True, temp_root=tmp_path / "tmp").fixed
    assert verify_dirs(tmp_path) == [] and run_doctor(kb, temp_root=tmp_path / "tmp").ok


def test_timeout_flag_gives_a_timeout_verdict(tmp_path: Path) -> None:
    res = subprocess.run([*KB_CLI, "verify", str(SPEC), str(FIX / "hangs.py"), "--timeout", "5", "--json"],
                         env=kb_env(tmp_path), capture_output=True, text=True, timeout=120)
    report = json.loads(res.stdout)
    assert res.returncode == 1 and report["verdict"] == "timeout" and "within 5s" in report["message"], res.stderr
    assert verify_dirs(tmp_path) == []


def test_verify_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().verify_timeout == 600.0
    monkeypatch.setenv("KB_VERIFY_TIMEOUT", "7.5")
    assert load_settings().verify_timeout == 7.5
    monkeypatch.setenv("KB_VERIFY_TIMEOUT", "0")
    with pytest.raises(KBError, match="positive number of seconds"):
        load_settings()


# ---- the pieces

def test_a_child_whose_parent_is_already_gone_dies_at_once() -> None:
    """The fork/prctl race: armed after its parent died, the process signals itself."""
    code = "from kb.procs import die_with_parent; die_with_parent(parent=1)(); import time; time.sleep(30)"
    res = subprocess.run([sys.executable, "-c", code], timeout=30)
    assert res.returncode == -signal.SIGKILL


def test_owner_sees_a_reused_pid_as_gone() -> None:
    me = Owner.current()
    assert me.alive() is True and Owner.parse(f"x {me.note} y") == me
    assert Owner(me.pid, me.host, me.start + 1).alive() is False  # same pid, another process
    assert Owner(me.pid, "another-host", me.start).alive() is None  # cannot tell
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert start_ticks(int(done.stdout)) is None
