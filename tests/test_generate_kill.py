"""A generation run stopped half-way leaves a recorded failed run and no half-written kernel."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.generate_fixtures import REPO

pytestmark = pytest.mark.network
KB = str(Path(sys.executable).parent / "kb")  # the console script, as a user runs it


def _rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return con.execute(sql).fetchall()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopped_generate_leaves_no_half_written_kernel(ingested_home: Path, tmp_path: Path, sig: int) -> None:
    home = tmp_path / "kb"
    shutil.copytree(ingested_home, home)
    db = home / "kb.sqlite"
    kernels_before = _rows(db, "select count(*) from kernels")[0][0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")} | {"KB_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([KB, "generate", str(REPO / "examples/specs/alibi.py"),
                             "--out", str(tmp_path / "out")], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline and not _rows(db, "select id from generation_runs where status = 'running'"):
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
        time.sleep(0.5)
    time.sleep(2.0)  # inside the attempts now
    proc.send_signal(sig)
    proc.wait(timeout=120)
    assert _rows(db, "select count(*) from kernels")[0][0] == kernels_before  # no kernel without its run and checks
    (status, error), = _rows(db, "select status, error from generation_runs")
    if sig == signal.SIGTERM:
        assert status == "failed" and "interrupted" in error
    else:  # SIGKILL cannot be caught: the run stays 'running', and nothing else was written
        assert status == "running"
    doctor = subprocess.run([KB, "doctor"], env=env, cwd=REPO, capture_output=True, text=True)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
