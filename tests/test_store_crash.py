"""A writer killed with SIGKILL mid-stream loses no committed row and leaves no half-written kernel;
`kb doctor --fix` then reports zero drift."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from kb.settings import load_settings
from kb.store import Kernel, Snippet, Tunable, open_kb
from tests.support.repo import REPO, subprocess_env
from tests.support.store import SNIPPETS_PER_KERNEL


def _writer(home: Path, start: int, count: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.store", str(home), str(start), str(count), *extra],
        cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _assert_whole(kb, committed: list[str]) -> None:
    """Every committed kernel is intact, and every kernel present has all of its rows."""
    kernels = {k.id: k for k in kb.list(Kernel)}
    assert set(committed) <= set(kernels)
    for kid, k in kernels.items():
        assert len(kb.list(Snippet, kernel_id=kid)) == SNIPPETS_PER_KERNEL, kid
        assert k.file and kb.list(Tunable, file="t.h")
    assert len(kb.list(Snippet)) == SNIPPETS_PER_KERNEL * len(kernels)


def _doctor_to_zero(kb) -> None:
    kb.doctor(fix=True)
    after = kb.doctor()
    assert after.ok, after.summary()
    assert kb.counts().vectors["kernels"] == kb.counts().rows["kernels"]
    assert kb.counts().vectors["snippets"] == kb.counts().rows["snippets"]


def test_kill_between_sql_commit_and_embedding(tmp_path: Path, embedder) -> None:
    # Upsert calls: kernel 0's kernels + snippets (2), kernel 1's (2), then kernel 2's first: die there.
    proc = _writer(tmp_path, 0, 10, "--kill-at-upsert", "5")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, stderr[-2000:]
    committed = [line.split()[1] for line in stdout.splitlines() if line.startswith("committed")]
    assert len(committed) == 2
    with open_kb(load_settings(home=tmp_path), embedder=embedder) as kb:
        assert kb.counts().rows["kernels"] == 3  # kernel 2 reached SQL before the kill
        before = kb.doctor()
        assert {d.kind.value for d in before.issues} == {"missing_embedding"}
        assert len(before.issues) == 1 + SNIPPETS_PER_KERNEL
        _assert_whole(kb, committed)
        _doctor_to_zero(kb)


def test_kill_at_an_arbitrary_moment(tmp_path: Path, embedder) -> None:
    proc = _writer(tmp_path, 0, 200)
    committed: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("committed"):
            committed.append(line.split()[1])
            if len(committed) == 6:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=60)
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    with open_kb(load_settings(home=tmp_path), embedder=embedder) as kb:
        _assert_whole(kb, committed)
        _doctor_to_zero(kb)
        for kid in committed:
            assert kb.get(kid).content_hash
