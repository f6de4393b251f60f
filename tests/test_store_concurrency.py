"""Two real processes writing to one KB at the same time lose nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kb.settings import load_settings
from kb.store import Kernel, Snippet, open_kb
from tests.support.repo import REPO, subprocess_env
from tests.support.store import SNIPPETS_PER_KERNEL


def test_two_writers_lose_nothing(tmp_path: Path, embedder) -> None:
    open_kb(load_settings(home=tmp_path), embedder=embedder).close()  # `kb init` first, as users do
    # Overlapping ranges: kernels 6..11 are written by both processes.
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.store", str(tmp_path), str(start), "12"],
            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for start in (0, 6)
    ]
    results = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    written = {line.split()[1] for out, _ in results for line in out.splitlines() if line.startswith("committed")}
    assert len(written) == 18
    with open_kb(load_settings(home=tmp_path), embedder=embedder) as kb:
        assert {k.id for k in kb.list(Kernel)} == written
        assert len(kb.list(Snippet)) == 18 * SNIPPETS_PER_KERNEL
        report = kb.doctor()
        assert report.ok, report.summary()
        assert kb.counts().vectors == {"kernels": 18, "snippets": 18 * SNIPPETS_PER_KERNEL, "lessons": 0}
