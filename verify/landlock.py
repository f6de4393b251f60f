"""Linux Landlock through ctypes: unprivileged, irrevocable limits on what a process may touch.

A process builds a *ruleset* (which rights it restricts, and which of them each path keeps), then
restricts itself with it; the restriction holds for it and every process it starts, whatever their
uid or capabilities, and cannot be lifted. What Landlock covers grows with the kernel's ABI version:

| ABI | kernel | adds |
|---|---|---|
| 1 | 5.13 | file system: read, write, execute, create, remove (renames across directories always denied) |
| 2 | 5.19 | `REFER`: renames and links across directories, when granted |
| 3 | 6.2  | `TRUNCATE` |
| 4 | 6.7  | TCP `bind` and `connect` |
| 6 | 6.12 | scopes: no signals to, no abstract Unix sockets of, processes outside the domain |

`Ruleset` is built in the parent (errors surface there, in Python); the child, between fork and exec,
only calls `restrict_self(fd)`, resolved before the fork. Not handled on purpose: `IOCTL_DEV` (ABI 5),
so the CUDA driver's ioctls on /dev/nvidia* stay as they are.
"""

from __future__ import annotations

import ctypes
import enum
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["FS", "NET", "SCOPE", "abi_version", "Ruleset", "restrict_self_fn", "READ", "WRITE"]

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same numbers on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38


class FS(enum.IntFlag):
    EXECUTE = 1 << 0
    WRITE_FILE = 1 << 1
    READ_FILE = 1 << 2
    READ_DIR = 1 << 3
    REMOVE_DIR = 1 << 4
    REMOVE_FILE = 1 << 5
    MAKE_CHAR = 1 << 6
    MAKE_DIR = 1 << 7
    MAKE_REG = 1 << 8
    MAKE_SOCK = 1 << 9
    MAKE_FIFO = 1 << 10
    MAKE_BLOCK = 1 << 11
    MAKE_SYM = 1 << 12
    REFER = 1 << 13  # ABI 2
    TRUNCATE = 1 << 14  # ABI 3


class NET(enum.IntFlag):
    BIND_TCP = 1 << 0  # ABI 4
    CONNECT_TCP = 1 << 1


class SCOPE(enum.IntFlag):
    ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
    SIGNAL = 1 << 1


READ = FS.EXECUTE | FS.READ_FILE | FS.READ_DIR
# create, remove, write, rename, truncate; never device nodes (a root process could make one for the disk)
WRITE = 0x7FFF & ~int(READ | FS.MAKE_CHAR | FS.MAKE_BLOCK)
_FILE_RIGHTS = FS.EXECUTE | FS.WRITE_FILE | FS.READ_FILE | FS.TRUNCATE  # the rights a rule on a non-directory may hold


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _syscall() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    return fn  # called as fn(SYSCALL_NR, *args)


def abi_version() -> tuple[int, str]:
    """(the kernel's Landlock ABI version, "") or (0, why there is none)."""
    call = _syscall()
    if call is None:
        return 0, f"Landlock is Linux only (this is {sys.platform})"
    got = call(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if got < 0:
        err = ctypes.get_errno()
        why = {38: "the kernel has no Landlock (CONFIG_SECURITY_LANDLOCK)",
               95: "Landlock is not enabled at boot (lsm= list)"}.get(err, os.strerror(err))
        return 0, why
    return int(got), ""


def _fs_mask(abi: int) -> int:
    mask = (1 << 13) - 1
    if abi >= 2:
        mask |= FS.REFER
    if abi >= 3:
        mask |= FS.TRUNCATE
    return mask


class Ruleset:
    """A Landlock ruleset fd: every handled file-system right is denied except where `allow` grants it;
    with `deny_tcp` (ABI >= 4) every TCP bind and connect is denied; `scoped` (ABI >= 6) keeps signals and
    abstract Unix sockets inside the domain. Close it once the child has started."""

    def __init__(self, abi: int, *, deny_tcp: bool, scoped: bool) -> None:
        call = _syscall()
        assert call is not None and abi >= 1
        self.abi, self._call, self._fs = abi, call, _fs_mask(abi)
        attr = _RulesetAttr(self._fs, int(NET.BIND_TCP | NET.CONNECT_TCP) if deny_tcp and abi >= 4 else 0,
                            int(SCOPE.ABSTRACT_UNIX_SOCKET | SCOPE.SIGNAL) if scoped and abi >= 6 else 0)
        size = ctypes.sizeof(ctypes.c_uint64) * (3 if abi >= 6 else 2 if abi >= 4 else 1)
        fd = call(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
        self.fd = int(fd)
        self.tcp_denied = bool(attr.handled_access_net)
        self.scoped = bool(attr.scoped)

    def allow(self, path: Path, access: int) -> None:
        """Grant `access` (masked to this ABI; to file rights for a non-directory) on `path` and beneath it."""
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            rights = access & self._fs
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                rights &= _FILE_RIGHTS
            rule = _PathBeneathAttr(rights, fd)
            if self._call(_ADD_RULE, ctypes.c_int(self.fd), ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule),
                          ctypes.c_uint32(0)) < 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)

    def close(self) -> None:
        os.close(self.fd)


def restrict_self_fn() -> Callable[[int], str]:
    """A function for the forked child: `restrict(fd)` sets no_new_privs and enforces ruleset `fd` on itself.

    Returns "" on success or the reason it failed (it never raises: a failure is reported, not fatal).
    libc is resolved here, before any fork."""
    call = _syscall()
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def restrict(fd: int) -> str:
        if call is None:
            return "not Linux"
        if prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}"
        if call(_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            return f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}"
        return ""

    return restrict
