"""A full disk under --out or under the KB: one line naming the path and what was kept, the run marked failed (never
left `running`), nothing half-written. A real tmpfs where the test can mount one, a simulated ENOSPC otherwise."""

from __future__ import annotations

import errno
import json
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from generate.pipeline import GenerateOptions, generate
from kb.store.models import GenerationRun, Kernel
from tests.support.generate_fixtures import QUICK
from tests.support.repo import KB_CLI, REPO, subprocess_env

SPEC = REPO / "examples" / "specs" / "causal_d64.py"


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (too small for one candidate file), or a skip where this process may not mount one."""
    where = tmp_path / "full"
    where.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                                                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); test_out_dir_full_simulated covers the same path")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


def _runs(home: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(home / "kb.sqlite") as db:
        return db.execute("select status, error from generation_runs").fetchall()


@pytest.mark.network  # the session KB ingests the pinned releases
def test_out_dir_on_a_full_tmpfs(ingested_kb_settings, tiny_tmpfs: Path) -> None:
    home = ingested_kb_settings.home
    proc = subprocess.run([*KB_CLI, "--home", str(home), "generate", str(SPEC), "--out", str(tiny_tmpfs), "--no-backward"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    line, = [x for x in proc.stderr.splitlines() if "failed" in x]
    assert "No space left on device" in line and str(tiny_tmpfs) in line, proc.stderr
    (status, error), = _runs(home)
    assert status == "failed" and "No space left on device" in error
    assert [p.name for p in tiny_tmpfs.iterdir()] in ([], ["gen_causal_d64.report.json"])  # no half-written kernel


def test_out_dir_full_simulated(ingested_kb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(Path, "write_bytes", full)
    r = generate(ingested_kb, SPEC, GenerateOptions(out_dir=tmp_path / "out", **QUICK))
    assert not r.succeeded and "No space left on device" in r.error and "gen_causal_d64" in r.error
    assert ingested_kb.get(r.run_id).status == "failed"
    assert not list((tmp_path / "out").glob("gen_causal_d64.py"))


def test_kb_full_keeps_the_published_files(ingested_kb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(records):
        raise OperationalError("INSERT", {}, Exception("database or disk is full"))

    kernels_before = len(ingested_kb.list(Kernel))
    monkeypatch.setattr(ingested_kb, "write_records", full)
    r = generate(ingested_kb, SPEC, GenerateOptions(out_dir=tmp_path / "out", **QUICK))
    assert not r.succeeded and r.kernel_id is not None
    assert "the KB could not be written (database or disk is full)" in r.error and str(tmp_path / "out") in r.error
    assert r.files["candidate"].is_file()  # what was verified is kept as files
    report = json.loads(r.files["report"].read_text())
    assert report["status"] == "verified" and "the KB could not be written" in report["error"]
    run = ingested_kb.get(r.run_id)
    assert isinstance(run, GenerationRun) and run.status == "failed"  # the run's own row still went in: not `running`
    assert len(ingested_kb.list(Kernel)) == kernels_before  # nothing of the write-back was half-written
