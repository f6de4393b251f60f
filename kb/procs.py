"""Process ownership: who owns a running thing, whether that owner still lives, and dying with a parent.

An `Owner` names one process for its whole life: host, pid and the process's start time in
clock ticks since boot (field 22 of /proc/PID/stat), so a pid that a later process reuses is
not mistaken for the owner. Generation runs record their owner while they are `running`, and
verify temp directories carry it in their name (`owned_prefix`: `kb-verify-PID-START-…`); `kb doctor` uses
`Owner.alive()` to find the ones whose process is gone.

`die_with_parent` arms Linux's PR_SET_PDEATHSIG. The kernel sends the signal when the *thread*
that forked the process exits, so the spawn must happen on a thread that outlives the child
(`verify.runner` spawns and waits on the same thread). Elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Owner", "start_ticks", "die_with_parent", "VERIFY_TEMP", "owned_prefix", "owner_of_temp"]

PR_SET_PDEATHSIG = 1
VERIFY_TEMP = "kb-verify-"  # the temp directories of `verify.runner`
_NOTE = re.compile(r"owner pid=(\d+) host=(\S+) start=(\d+)")
_TEMP = re.compile(r"(\d+)-(\d+)-")


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot); None if it does not run (or is a zombie); 0 where /proc is absent."""
    if not os.path.isdir("/proc/self"):
        return 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no such process (ENOENT, or ESRCH while it exits)
        return None
    # comm (field 2) may hold spaces and parentheses: fields 3.. follow the last ')'
    rest = stat[stat.rindex(b")") + 2:].split()
    return None if rest[0] in (b"Z", b"X") else int(rest[19])  # a zombie has exited


@dataclass(frozen=True)
class Owner:
    pid: int
    host: str
    start: int  # start_ticks(pid) when recorded; 0 where unknown

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, socket.gethostname(), start_ticks(pid) or 0)

    @property
    def note(self) -> str:
        """One line a text column can hold; `Owner.parse` reads it back."""
        return f"owner pid={self.pid} host={self.host} start={self.start}"

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        m = _NOTE.search(text or "")
        return cls(int(m[1]), m[2], int(m[3])) if m else None

    def alive(self) -> bool | None:
        """True if the owner still runs, False if it is gone, None if it runs on another host (cannot tell)."""
        if self.host != socket.gethostname():
            return None
        now = start_ticks(self.pid)
        if now is None:
            return False
        if now and self.start:
            return now == self.start
        try:  # no start time to compare (no /proc): a signal-0 probe
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def owned_prefix(kind: str = VERIFY_TEMP) -> str:
    """`kb-verify-PID-START-`: a temp directory prefix naming this process as its owner."""
    me = Owner.current()
    return f"{kind}{me.pid}-{me.start}-"


def owner_of_temp(name: str, kind: str = VERIFY_TEMP) -> Owner | None:
    """The owner named by a temp directory made with `owned_prefix` (on this host), or None."""
    m = _TEMP.match(name.removeprefix(kind)) if name.startswith(kind) else None
    return Owner(int(m[1]), socket.gethostname(), int(m[2])) if m else None


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> Callable[[], None]:
    """A function for `preexec_fn` (or to call in a new process): receive `sig` when the parent dies.

    `parent` is the pid expected as parent (default: the caller, for preexec_fn). If it is already
    gone when the signal is armed (the race between fork and prctl), `sig` is sent at once.
    libc is resolved here, before any fork: the returned function only makes the call.
    """
    expected = os.getpid() if parent is None else parent
    if not sys.platform.startswith("linux"):
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != expected:
            os.kill(os.getpid(), sig)

    return arm
