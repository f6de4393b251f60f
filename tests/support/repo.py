"""Where things are: this checkout, the download cache, and how a child process runs `kb` from it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["KB_CLI", "REPO", "TEST_CACHE", "subprocess_env"]

REPO = Path(__file__).resolve().parents[2]
TEST_CACHE = REPO / ".kb-test-cache"  # pinned releases downloaded once, kept between runs (gitignored)
# `kb` as a child process: the console script is `cli.main:app`; `-m` runs this checkout's code (cwd=REPO or PYTHONPATH=REPO)
KB_CLI = (sys.executable, "-m", "cli.main")


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: no KB_* leakage, offline model, the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO), **extra)
    return env
