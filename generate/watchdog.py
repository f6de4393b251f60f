"""A wall-clock bound on what a spec runs inside `kb generate`'s own process (its import, tracing and reference).

The candidate kernels run in the verifier's child, which has its own timeout; the spec's Python runs here, and a
`forward` that never returns would hang `kb generate --timeout 60` forever. `watchdog(seconds, what)` arms SIGALRM
for the block; when it fires, the code running then (a Python loop in the spec, or the first bytecode after a long
C call) raises `BudgetSpent`, a KBError the pipeline records as the run's failure. A verifier child running at that
moment is killed by the runner on its way out.

SIGALRM exists only on POSIX and only the main thread receives it: elsewhere the block runs unbounded, said once in
the log.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kb.errors import KBError

__all__ = ["BudgetSpent", "watchdog"]

log = logging.getLogger(__name__)
_warned: list[bool] = []


class BudgetSpent(KBError):
    """The spec's --timeout ran out while code of this process was running."""


@contextmanager
def watchdog(seconds: float, what: str) -> Iterator[None]:
    """Run the block for at most `seconds` of wall time, else raise BudgetSpent naming `what`."""
    if seconds <= 0:
        raise BudgetSpent(f"{what}: the spec's budget (--timeout) is spent")
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        if not _warned:
            _warned.append(True)
            log.warning("%s runs without a time bound here (SIGALRM needs the main thread of a POSIX process)", what)
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise BudgetSpent(f"{what} did not finish within {seconds:g}s (--timeout); nothing was kept from it")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
