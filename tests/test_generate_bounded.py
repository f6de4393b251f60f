"""`kb generate` on specs that misbehave while kb imports and traces them: bounded by --timeout, one line each,
a failed run recorded, and a batch goes on with the next spec."""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests.support.repo import KB_CLI, REPO, subprocess_env

_HANG_GUARD_S = 900  # a hang guard for the child `kb`, far above the --timeout under test

_MODEL = '''import torch, torch.nn as nn
{top}
class Model(nn.Module):
    def forward(self, q, k, v):
{body}        return torch.softmax(q @ k.transpose(-2, -1), -1) @ v
def get_inputs():
    return [torch.randn(1, 2, 8, 16) for _ in range(3)]
def get_init_inputs():
    return []
'''


def _spec(path: Path, top: str = "", body: str = "") -> Path:
    path.write_text(_MODEL.format(top=top, body="".join(f"        {line}\n" for line in body.splitlines())))
    return path


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "kb"
    proc = subprocess.run([*KB_CLI, "--home", str(home), "init"], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=_HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    return home


def _generate(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KB_CLI, "--home", str(home), "generate", *args, "--out", str(home / "out")], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=_HANG_GUARD_S)


def _runs(home: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(home / "kb.sqlite") as db:
        return sorted(db.execute("select spec_path, status, error from generation_runs").fetchall())


def test_a_forward_that_never_returns_is_bounded_by_the_timeout(home: Path, tmp_path: Path) -> None:
    spec = _spec(tmp_path / "hangs.py", body="while True:\n    pass")
    proc = _generate(home, str(spec), "--timeout", "10")
    assert proc.returncode == 1
    assert "importing and tracing spec" in proc.stderr and "did not finish within 10s (--timeout)" in proc.stderr
    assert "Traceback" not in proc.stderr
    (path, status, error), = _runs(home)
    assert path == str(spec) and status == "failed" and "did not finish within 10s" in error


def test_sys_exit_and_undecodable_specs_fail_one_line_each_and_the_batch_goes_on(home: Path, tmp_path: Path) -> None:
    batch = tmp_path / "batch"
    batch.mkdir()
    _spec(batch / "a_exits_on_import.py", top="import sys\nsys.exit(3)")
    _spec(batch / "b_exits_in_forward.py", body="raise SystemExit(4)")
    (batch / "c_not_utf8.py").write_bytes(b'NAME = "caf\xe9"  # latin-1, not UTF-8\n' + _MODEL.format(top="", body="").encode())
    proc = _generate(home, "--all", str(batch))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if ": failed" in line]
    assert len(lines) == 3, proc.stderr
    assert "it called sys.exit(3)" in lines[0] and "called sys.exit(4) while kb traced it" in lines[1]
    assert "c_not_utf8.py" in lines[2] and "cannot import spec file" in lines[2] and "utf-8" in lines[2]
    runs = _runs(home)
    assert [Path(p).name for p, _, _ in runs] == ["a_exits_on_import.py", "b_exits_in_forward.py", "c_not_utf8.py"]
    assert {status for _, status, _ in runs} == {"failed"}
