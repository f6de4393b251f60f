"""`kb doctor` finds what a kill or an older kernel-kb left: dead runs, broken lineage, orphaned temp dirs; --fix clears them."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from kb.procs import Owner
from kb.store import GenerationRun
from kb.store.doctor import DriftKind, run_doctor
from tests.support.store import make_kernel, make_source


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)


def _sql(kb, statements: list[tuple[str, tuple]]) -> None:
    """Raw writes with foreign keys off: the damage an older kernel-kb or a hand edit could leave."""
    with sqlite3.connect(kb.engines.target.path) as con:
        for sql, args in statements:
            con.execute(sql, args)


def _run(kb, spec: str, note: str, status: str = "running") -> str:
    return kb.write_run(GenerationRun(spec_path=spec, engine="rule", status=status, error=note))


def test_runs_whose_process_is_gone_are_marked_interrupted(kb) -> None:
    me = Owner.current()
    dead = _run(kb, "dead.py", Owner(_dead_pid(), me.host, 1).note)
    reused = _run(kb, "reused.py", Owner(me.pid, me.host, me.start + 1).note)  # this pid, another process's start
    alive = _run(kb, "alive.py", me.note)
    elsewhere = _run(kb, "elsewhere.py", Owner(me.pid, "another-host", me.start).note)
    unknown = _run(kb, "unknown.py", "")
    finished = _run(kb, "finished.py", "some failure", status="failed")

    report = run_doctor(kb)
    assert {(d.kind, d.id) for d in report.issues} == {(DriftKind.STUCK_RUN, r) for r in (dead, reused, unknown)}
    assert not report.ok and not report.fixed
    assert run_doctor(kb, fix=True).fixed and run_doctor(kb).ok
    for rid in (dead, reused, unknown):
        row = kb.get(rid)
        assert row.status == "interrupted" and row.error.startswith("interrupted: ") and "kb doctor" in row.error
    assert "is gone" in kb.get(dead).error
    assert [kb.get(r).status for r in (alive, elsewhere, finished)] == ["running", "running", "failed"]


def test_broken_and_cyclic_lineage_is_cut_and_reported(kb) -> None:
    src = kb.write_source(make_source())
    a, b, c, d, e = (kb.write_kernel(make_kernel(i, src)) for i in range(5))
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    _sql(kb, [("UPDATE kernels SET parent_id = ? WHERE id = ?", ("k-gone000000000000", a)),  # parent not in the KB
              ("UPDATE kernels SET parent_id = ?, created_at = ? WHERE id = ?", (c, t0.isoformat(), b)),  # b -> c -> d -> b
              ("UPDATE kernels SET parent_id = ?, created_at = ? WHERE id = ?", (d, (t0 + timedelta(days=2)).isoformat(), c)),
              ("UPDATE kernels SET parent_id = ?, created_at = ? WHERE id = ?", (b, (t0 + timedelta(days=1)).isoformat(), d)),
              ("UPDATE kernels SET parent_id = ? WHERE id = ?", (e, e))])  # its own parent

    report = run_doctor(kb)
    found = {(x.kind, x.id): x.detail for x in report.issues}
    assert set(found) == {(DriftKind.MISSING_PARENT, a), (DriftKind.LINEAGE_CYCLE, c), (DriftKind.LINEAGE_CYCLE, e)}
    assert "k-gone000000000000" in found[(DriftKind.MISSING_PARENT, a)]
    assert all(k in found[(DriftKind.LINEAGE_CYCLE, c)] for k in (b, c, d))  # the cycle is named; c (newest) is cut

    assert run_doctor(kb, fix=True).fixed and run_doctor(kb).ok
    assert [kb.get(k).parent_id for k in (a, b, c, d, e)] == [None, c, None, b, None]
    assert [k.id for k in kb.lineage(b)] == [b, c]


def test_cli_doctor_json_reports_and_fixes_every_kind(kb, kb_settings, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = tmp_path / "tmp"
    orphan = tmp / f"kb-verify-{_dead_pid()}-123-abcd1234"  # left by a SIGKILLed kb verify
    orphan.mkdir(parents=True)
    mine = Owner.current()
    live = tmp / f"kb-verify-{mine.pid}-{mine.start}-live5678"  # a verify in flight: kept
    live.mkdir()
    (tmp / "kb-verify-legacy12").mkdir()  # no owner in its name (an older kernel-kb): left alone
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    run = _run(kb, "dead.py", Owner(_dead_pid(), mine.host, 1).note)
    home = str(kb_settings.home)

    res = CliRunner().invoke(app, ["--home", home, "doctor", "--json"])
    doc = json.loads(res.output)
    assert res.exit_code == 1 and doc["ok"] is False and doc["fixed"] is False
    assert [(i["kind"], i["table"], i["id"]) for i in doc["issues"]] == [
        ("stuck_run", "generation_runs", run), ("orphan_temp_dir", "tmp", str(orphan))]
    fixed = CliRunner().invoke(app, ["--home", home, "doctor", "--fix", "--json"])
    assert fixed.exit_code == 0 and json.loads(fixed.output)["fixed"] is True
    assert sorted(p.name for p in tmp.iterdir()) == sorted([live.name, "kb-verify-legacy12"])
    again = CliRunner().invoke(app, ["--home", home, "doctor"])
    assert again.exit_code == 0 and again.output.strip().startswith("no issues"), again.output
