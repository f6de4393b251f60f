"""Real processes in tests: the /proc table, waiting for a process group to end, a `kb` child's environment."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.repo import REPO

__all__ = ["group_ends", "kb_env", "live_in_group", "proc_table", "sigint_default", "verify_dirs", "wait_for"]


def proc_table() -> list[tuple[int, int, int, str, str]]:
    """(pid, ppid, pgrp, state, cmdline) of every process now; zombies included (state Z)."""
    rows = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_bytes()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rindex(b")") + 2:].split()
        rows.append((int(d.name), int(rest[1]), int(rest[2]), rest[0].decode(), cmd))
    return rows


def live_in_group(pgid: int) -> list[str]:
    """Processes of group `pgid` that still run (a zombie has exited; only its parent's wait is missing)."""
    return [f"{pid} {cmd}" for pid, _, pg, state, cmd in proc_table() if pg == pgid and state not in ("Z", "X")]


def group_ends(pgid: int, timeout: float = 15.0) -> bool:
    """True once no process of group `pgid` runs (the reaper acts in milliseconds; the margin is for a loaded machine)."""
    deadline = time.monotonic() + timeout
    while live_in_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not live_in_group(pgid)


def wait_for(what: Callable[[], object], timeout: float, proc: subprocess.Popen | None = None) -> object:
    """Poll `what` until it is truthy; fail if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"kb exited early ({proc.returncode}): {(out or b'')[-1500:]!r} {(err or b'')[-1500:]!r}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def sigint_default() -> None:
    """preexec_fn: a process started from a non-interactive shell inherits SIGINT ignored; a user's Ctrl-C is not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kb_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return env | {"KB_HOME": str(tmp_path / "kb"), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path / "tmp"),
                  "PYTHONPATH": str(REPO)} | extra


def verify_dirs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "tmp").glob("kb-verify-*"))
