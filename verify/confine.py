"""What a sandboxed child does to itself between fork and exec (subprocess's `preexec_fn`).

In order: a new network (and IPC) namespace, resource limits, dropping every capability (a process run by
root keeps uid 0 but loses what root may do beyond file ownership: load modules, override permissions, raw
I/O), the seccomp filter (verify.seccomp: no Unix-domain sockets), the Landlock restriction, and last the parent-death signal (armed after every credential change, which
could clear it). Everything that can be
resolved before the fork is (libc functions, the Landlock ruleset); what the child tried and why a step
failed goes back to the parent as `key=reason` lines on a pipe the child's exec closes (`Plan.status_fd`),
so a missing isolation is reported, never fatal. The one step that aborts the spawn is a user namespace
whose id maps cannot be written (files could not even be created there): `UserNamespaceUnusable` makes
`subprocess` raise, and the caller spawns again without a namespace.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kb.procs import die_with_parent
from verify import seccomp
from verify.landlock import FS, READ, Ruleset, restrict_self_fn

__all__ = ["Plan", "preexec", "parse_status", "UserNamespaceUnusable"]

CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_CAP_V3 = 0x20080522
_LINUX = sys.platform.startswith("linux")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class UserNamespaceUnusable(OSError):
    pass


@dataclass(frozen=True)
class Plan:
    status_fd: int  # write end of the status pipe (close-on-exec)
    new_netns: bool
    rlimits: tuple[tuple[int, int], ...]  # (RLIMIT_*, value): soft = hard = value
    ruleset: Ruleset | None
    no_unix_sockets: bool = True


def _unshare_fn() -> Callable[[int], int]:
    if not _LINUX:
        return lambda flags: errno.ENOSYS
    unshare = ctypes.CDLL(None, use_errno=True).unshare
    unshare.argtypes = [ctypes.c_int]

    def call(flags: int) -> int:
        return 0 if unshare(flags) == 0 else ctypes.get_errno()

    return call


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _new_netns(unshare: Callable[[int], int]) -> str:
    """Enter a new network and IPC namespace: directly when privileged, else inside a new user namespace that maps
    this process's own uid and gid (so files and permissions look the same). "" or why not."""
    err = unshare(CLONE_NEWNET | CLONE_NEWIPC)
    if err == 0:
        return ""
    uid, gid = os.geteuid(), os.getegid()
    user_err = unshare(CLONE_NEWUSER)
    if user_err:
        return f"unshare(CLONE_NEWNET): {os.strerror(err)}; unshare(CLONE_NEWUSER): {os.strerror(user_err)}"
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as map_err:
        raise UserNamespaceUnusable(map_err.errno, f"unshare(CLONE_NEWNET): {os.strerror(err)}; "
                                                   f"user namespace id maps: {map_err.strerror}") from None
    err = unshare(CLONE_NEWNET | CLONE_NEWIPC)
    return f"unshare(CLONE_NEWNET) in a user namespace: {os.strerror(err)}" if err else ""


def _drop_caps_fn() -> Callable[[], str]:
    if not _LINUX:
        return lambda: f"not Linux ({sys.platform})"
    libc = ctypes.CDLL(None, use_errno=True)
    prctl, capset = libc.prctl, libc.capset
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def drop() -> str:
        """Empty the bounding set (an exec as uid 0 would otherwise get every capability in it back; emptying it needs
        CAP_SETPCAP, which a process without capabilities cannot have and does not need), the ambient set and the
        effective, permitted and inheritable sets. "" when none is left where it matters, or what is left."""
        for cap in range(64):
            if prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
                break  # past the last capability this kernel knows
        prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        if capset(ctypes.byref(_CapHeader(_CAP_V3, 0)), (_CapData * 2)()) != 0:
            return f"capset: {os.strerror(ctypes.get_errno())}"
        left = _caps()
        if left.get("CapEff") or left.get("CapPrm") or left.get("CapAmb") or (os.geteuid() == 0 and left.get("CapBnd")):
            return "still held: " + " ".join(f"{k}={v:x}" for k, v in left.items() if v)
        return ""

    return drop


def _caps() -> dict[str, int]:
    """This process's capability sets (CapInh, CapPrm, CapEff, CapBnd, CapAmb) from /proc/self/status."""
    with open("/proc/self/status", "rb") as f:
        return {k.decode(): int(v, 16) for k, v in (line.split(b":", 1) for line in f if line.startswith(b"Cap"))}


def preexec(plan: Plan) -> Callable[[], None]:
    unshare, restrict, arm = _unshare_fn(), restrict_self_fn(), die_with_parent(signal.SIGKILL)
    drop_caps, install_filter = _drop_caps_fn(), seccomp.install_fn()

    def confine() -> None:
        status = []
        if plan.new_netns:
            try:
                status.append(f"net={_new_netns(unshare)}")
            except UserNamespaceUnusable as err:
                os.write(plan.status_fd, f"userns={err.strerror}\n".encode())
                raise
        for which, value in plan.rlimits:
            resource.setrlimit(which, (value, value))
        status.append(f"caps={drop_caps()}")
        if plan.no_unix_sockets:
            status.append(f"unix={install_filter()}")
        if plan.ruleset is not None:
            try:  # this process may reset its own peak RSS (/proc/self/clear_refs); its children may not
                plan.ruleset.allow(Path(f"/proc/{os.getpid()}"), READ | FS.WRITE_FILE | FS.TRUNCATE)
            except OSError:
                pass
            status.append(f"fs={restrict(plan.ruleset.fd)}")
        os.write(plan.status_fd, "".join(s.replace("\n", " ") + "\n" for s in status).encode())
        arm()

    return confine


def parse_status(text: str) -> dict[str, str]:
    """The child's `key=reason` lines: reason "" means the step took effect."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
