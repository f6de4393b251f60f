"""The reaper: `python -m verify.reaper PARENT_PID`, started by `verify.child` inside its own process group.

It waits, and when its parent (the child) dies, for whatever reason, SIGKILLs the whole group:
whatever the candidate started (worker processes, compilers) dies with it. The child itself
gets SIGKILL when *its* parent (the `kb` process) dies (PR_SET_PDEATHSIG, armed by
`verify.runner`), so `kb` SIGKILLed -> child killed -> reaper signalled -> group killed.
A separate process, because the child may be stuck in C code where no Python handler runs.
"""

from __future__ import annotations

import os
import signal
import sys

from kb.procs import die_with_parent

__all__ = ["main"]


def _reap(signum: int, frame: object) -> None:
    os.killpg(0, signal.SIGKILL)  # this process's group: the child's; the reaper goes with it


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _reap)
    die_with_parent(signal.SIGTERM, parent=int(argv[0]))()
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
