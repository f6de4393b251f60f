"""A seccomp filter that keeps a sandboxed child off the user's local services: no Unix-domain sockets.

A network namespace cuts TCP and UDP, but a socket *file* stays reachable through the file system, and
Landlock does not cover connect(2) on one: the session bus in /run/user/UID (`systemd-run --user` runs
anything, unconfined), the Docker socket, an ssh-agent, a PostgreSQL server with peer authentication.
The filter makes `socket(AF_UNIX, ...)` fail with EPERM, and `io_uring_setup` too (io_uring can create and
connect sockets without those system calls). It denies every system call made through another ABI than
the native one (x86_64's 32-bit and x32 entry points), whose arguments it could not check. Everything else
is allowed. Python, PyTorch, Triton and the CUDA driver make no Unix-domain socket in a verification;
glibc's name-service lookups that try one (nscd, systemd-userdb) fall back to /etc files.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Callable

__all__ = ["supported", "install_fn"]

# per machine: (AUDIT_ARCH_*, __NR_socket, __NR_io_uring_setup)
_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
_X32_BIT = 0x40000000
_AF_UNIX = 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
# classic BPF opcodes
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16  # struct seccomp_data (little-endian: arg0's low word at 16)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def supported() -> tuple[bool, str]:
    """(whether the filter exists for this machine, why not)."""
    machine = platform.machine()
    if not platform.system() == "Linux":
        return False, f"seccomp is Linux only (this is {platform.system()})"
    if machine not in _ARCH:
        return False, f"no filter written for {machine}"
    return True, ""


def _program(arch: int, nr_socket: int, nr_io_uring: int) -> list[tuple[int, int, int, int]]:
    deny = _RET_ERRNO | errno.EPERM
    return [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ_K, 1, 0, arch),  # native ABI: go on; else deny
        (_RET_K, 0, 0, deny),
        (_LD_W_ABS, 0, 0, _OFF_NR),
        (_JGE_K, 0, 1, _X32_BIT),  # x32 system calls share x86_64's arch value
        (_RET_K, 0, 0, deny),
        (_JEQ_K, 0, 1, nr_io_uring),
        (_RET_K, 0, 0, deny),
        (_JEQ_K, 1, 0, nr_socket),
        (_RET_K, 0, 0, _RET_ALLOW),
        (_LD_W_ABS, 0, 0, _OFF_ARG0),
        (_JEQ_K, 0, 1, _AF_UNIX),
        (_RET_K, 0, 0, deny),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]


def install_fn() -> Callable[[], str]:
    """A function for the forked child: install the filter on itself ("" or why not). Built before the fork."""
    ok, why = supported()
    if not ok:
        return lambda: why
    code = _program(*_ARCH[platform.machine()])
    filters = (_SockFilter * len(code))(*[_SockFilter(*c) for c in code])
    prog = _SockFprog(len(code), ctypes.cast(filters, ctypes.POINTER(_SockFilter)))
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]

    def install(_keep: object = (filters, prog)) -> str:  # the default holds the filter's memory until the fork
        if prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
            return f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}"
        if prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
            return f"prctl(PR_SET_SECCOMP): {os.strerror(ctypes.get_errno())}"
        return ""

    return install
