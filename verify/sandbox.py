"""Run a Python entry point on code we did not write, confined: `Sandbox(policy).run(module, args, timeout_s)`.

```
with Sandbox(SandboxPolicy(readable=(spec_dir,))) as box:     # a temp dir owned by this process (kb doctor: orphans)
    (box.workdir / "request.json").write_text(...)
    run = box.run("verify.child", [...], timeout_s=600)      # python -m verify.child ..., confined
    run.returncode, run.stderr, run.timed_out, run.isolation
```
The child (`python -m MODULE ARGS`, this interpreter) gets:
- a scrubbed environment (verify.sandbox_env: an allow-list; never `KB_*`, keys, tokens, passwords), with
  HOME, TMPDIR and its cwd in `workdir`, the compiler caches (Triton, Inductor, CUDA) in the sandbox's
  own cache directory (`default_cache_dir()`, never the user's: a planted cache entry there would run in
  the user's own processes later), and PYTHONPATH starting at this project's code;
- no network where the OS lets it make a new network namespace (verify.confine), else TCP denied by
  Landlock (ABI >= 4), else none; no Unix-domain sockets (verify.seccomp), which reach local services;
- resource limits: address space (when asked), CPU time, open files, file size, no core dumps;
- a Landlock view (verify.sandbox_fs) where the kernel has it (ABI >= 2): the user's home and KB home
  hidden except the paths the child needs, everything else read-only, writes only to `workdir` and the
  cache directory; signals and abstract Unix sockets kept inside (ABI >= 6);
- its own session and process group, SIGKILLed on every way out of `run` (result, timeout, exception), and
  the parent-death signal (SIGKILL) for the way out that runs no code (this process SIGKILLed).
What is in force is `run.isolation`; each missing layer is logged once per process as one warning.
`run` spawns and waits on the calling thread (the parent-death signal follows the forking thread).
"""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from kb.procs import VERIFY_TEMP, owned_prefix
from kb.settings import default_home
from verify import confine
from verify.landlock import Ruleset, abi_version
from verify.sandbox_env import scrub_env
from verify.sandbox_fs import FsView

__all__ = ["SandboxPolicy", "Isolation", "SandboxRun", "Sandbox", "default_cache_dir", "default_hidden", "HARNESS_ROOT"]

log = logging.getLogger(__name__)

HARNESS_ROOT = Path(__file__).resolve().parents[1]  # the directory holding this project's packages
_MIB = 1024 * 1024
_warned: set[tuple[str, ...]] = set()


def default_cache_dir() -> Path:
    """Where sandboxed children keep compiler caches: `$XDG_CACHE_HOME/kernel-kb/sandbox` (~/.cache/...)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kernel-kb" / "sandbox"


def default_hidden() -> tuple[Path, ...]:
    """Trees a sandboxed child never reads: the user's home and the KB home (its config.toml may hold keys)."""
    return (Path.home(), Path(os.environ.get("KB_HOME") or default_home()).expanduser())


@dataclass(frozen=True)
class SandboxPolicy:
    """What a sandboxed child may do beyond the defaults. Paths are added to the built-in ones, never replace them."""

    network: bool = False  # True: no network namespace, TCP allowed
    unix_sockets: bool = False  # True: no seccomp filter; Unix-domain sockets (local services) allowed
    memory_limit_mib: int | None = None  # RLIMIT_AS; None on CUDA (its context reserves huge virtual ranges)
    cpu_time_s: int | None = None  # RLIMIT_CPU; None: the timeout x the cores + 60 s, a backstop behind the timeout
    open_files: int = 4096
    file_size_mib: int = 4096
    readable: tuple[Path, ...] = ()  # made readable even inside a hidden tree (a spec's directory)
    writable: tuple[Path, ...] = ()
    hidden: tuple[Path, ...] = ()  # besides default_hidden()
    set_env: Mapping[str, str] = field(default_factory=dict)  # set in the child (TRITON_INTERPRET=1)
    pass_env: tuple[str, ...] = ()  # extra variables to pass; never KB_* or secret-looking names
    python_path: tuple[Path, ...] = ()  # import roots after HARNESS_ROOT, before the user's PYTHONPATH
    cache_dir: Path | None = None  # None: default_cache_dir()


@dataclass(frozen=True)
class Isolation:
    """What confined one child. `network`: "namespace" (no network), "tcp-denied" (Landlock: no TCP; UDP open),
    "open" (nothing in force), "allowed" (the policy allowed it). `unix_sockets`: "blocked" (seccomp) or "open". `filesystem`: "landlock" (the
    view of verify.sandbox_fs) or "open" (writes wherever the user can). `missing` says why, one line per layer."""

    env: str = "scrubbed"
    withheld_env: tuple[str, ...] = ()  # names (never values) of the variables not passed
    workdir: str = ""
    network: str = "open"
    unix_sockets: str = "open"  # "blocked" (seccomp), "open", "allowed" (the policy allowed them)
    filesystem: str = "open"
    landlock_abi: int = 0
    signals_scoped: bool = False  # Landlock ABI >= 6: no signal to a process outside the sandbox
    limits: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Isolation:
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        return cls(**kw)

    def summary(self) -> str:
        parts = [f"env {self.env}", f"network {self.network}", f"Unix sockets {self.unix_sockets}",
                 f"files {self.filesystem}", *self.limits]
        return ", ".join(parts)


@dataclass(frozen=True)
class SandboxRun:
    returncode: int | None  # None when it timed out; negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool
    isolation: Isolation


class Sandbox:
    """A directory owned by this process (named by `kb.procs.owned_prefix(kind)`, removed on exit; `kb doctor` removes
    one whose owner died) and the confined children started in it."""

    def __init__(self, policy: SandboxPolicy | None = None, kind: str = VERIFY_TEMP) -> None:
        self.policy, self.kind = policy or SandboxPolicy(), kind
        self.workdir = Path()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Sandbox:
        self._tmp = tempfile.TemporaryDirectory(prefix=owned_prefix(self.kind))
        self.workdir = Path(self._tmp.name)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()

    def run(self, module: str, args: Sequence[str], timeout_s: float) -> SandboxRun:
        """`python -m module *args` confined, with stdout and stderr captured; its process group is SIGKILLed before
        this returns or raises. A run past `timeout_s` seconds is `timed_out` (its output is dropped)."""
        proc, isolation = self._spawn(module, args, timeout_s)
        try:
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return SandboxRun(None, "", "", True, isolation)
            return SandboxRun(proc.returncode, out, err, False, isolation)
        finally:
            _kill_group(proc)

    def start(self, module: str, args: Sequence[str], stderr_path: Path) -> tuple[subprocess.Popen[str], Isolation]:
        """`python -m module *args` confined and left running, for a worker that answers requests on its stdin and
        stdout (text, line-buffered by the caller); its stderr goes to `stderr_path`. The caller stops it with
        `stop(proc)`; the policy's `cpu_time_s` bounds its CPU time over its whole life."""
        with open(stderr_path, "w") as stderr:
            return self._spawn(module, args, 600.0, stdin=subprocess.PIPE, stderr=stderr)

    @staticmethod
    def stop(proc: subprocess.Popen[str]) -> None:
        """SIGKILL a started child's process group and reap it."""
        _kill_group(proc)

    # ---- setting it up
    def _cache(self) -> Path:
        cache = (self.policy.cache_dir or default_cache_dir()).resolve()
        for sub in ("triton", "triton-home", "inductor", "nv", "xdg"):
            (cache / sub).mkdir(parents=True, exist_ok=True)
        return cache

    def _env(self, cache: Path) -> tuple[dict[str, str], tuple[str, ...]]:
        p = self.policy
        user_path = [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]
        work = str(self.workdir)
        fixed = {"HOME": work, "TMPDIR": work, "TMP": work, "TEMP": work, "XDG_CACHE_HOME": str(cache / "xdg"),
                 "TRITON_HOME": str(cache / "triton-home"), "TRITON_CACHE_DIR": str(cache / "triton"),
                 "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "CUDA_CACHE_PATH": str(cache / "nv"),
                 "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(HARNESS_ROOT), *map(str, p.python_path), *user_path]))}
        return scrub_env(os.environ, {**fixed, **p.set_env}, p.pass_env)

    def _view(self, cache: Path) -> FsView:
        p = self.policy
        exe = Path(sys.executable)
        needed = [HARNESS_ROOT, *p.python_path, exe.parent, exe.resolve().parent, Path(sys.prefix), Path(sys.base_prefix),
                  Path(sys.exec_prefix), Path(sys.base_exec_prefix), *p.readable]
        needed += [Path(x).resolve() for x in sys.path if x and os.path.isdir(x)]
        for var in ("PYTHONPATH", "LD_LIBRARY_PATH", "PATH"):
            needed += [Path(x) for x in os.environ.get(var, "").split(os.pathsep) if x and os.path.isabs(x)]
        for var in ("CUDA_HOME", "CUDA_PATH", "VIRTUAL_ENV", "CONDA_PREFIX"):
            if os.environ.get(var):
                needed.append(Path(os.environ[var]))
        return FsView(hidden=(*default_hidden(), *p.hidden), readable=tuple(needed),
                      writable=(self.workdir, cache, *p.writable))

    def _limits(self, timeout_s: float) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
        """((RLIMIT_*, value), ...) and how each reads; a value above the current hard limit is lowered to it."""
        p = self.policy
        wanted = [(resource.RLIMIT_CPU, p.cpu_time_s or math.ceil(timeout_s * (os.cpu_count() or 1)) + 60, "CPU time {} s", 1),
                  (resource.RLIMIT_NOFILE, p.open_files, "open files {}", 1),
                  (resource.RLIMIT_FSIZE, p.file_size_mib * _MIB, "file size {} MiB", _MIB),
                  (resource.RLIMIT_CORE, 0, "core dumps {} bytes", 1)]
        if p.memory_limit_mib is not None:
            wanted.insert(0, (resource.RLIMIT_AS, p.memory_limit_mib * _MIB, "address space {} MiB", _MIB))
        limits, said = [], []
        for which, value, text, unit in wanted:
            hard = resource.getrlimit(which)[1]
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            limits.append((which, value))
            said.append(text.format(value // unit))
        return tuple(limits), tuple(said)

    def _ruleset(self, cache: Path) -> tuple[Ruleset | None, int, str]:
        """(the Landlock ruleset, the ABI, why there is none)."""
        abi, why = abi_version()
        if abi == 0:
            return None, 0, f"no Landlock ({why})"
        if abi < 2:
            return None, abi, "Landlock ABI 1 (Linux < 5.19) cannot allow the renames Triton's cache makes"
        rules = self._view(cache).rules()
        ruleset = Ruleset(abi, deny_tcp=not self.policy.network, scoped=True)
        try:
            for path, rights in rules:
                try:
                    ruleset.allow(path, rights)
                except OSError as err:  # a special file, a path gone since the walk: it stays unreadable
                    log.debug("sandbox view: no rule for %s (%s)", path, err)
        except BaseException:
            ruleset.close()
            raise
        return ruleset, abi, ""

    def _spawn(self, module: str, args: Sequence[str], timeout_s: float, stdin: int | None = subprocess.DEVNULL,
               stderr: Any = subprocess.PIPE) -> tuple[subprocess.Popen[str], Isolation]:
        cache = self._cache()
        env, withheld = self._env(cache)
        rlimits, limit_text = self._limits(timeout_s)
        ruleset, abi, no_landlock = self._ruleset(cache)
        argv = [sys.executable, "-m", module, *args]
        try:
            streams = (stdin, stderr)
            proc, status = self._start(argv, env, confine.Plan(-1, not self.policy.network, rlimits, ruleset,
                                                               not self.policy.unix_sockets), streams)
            userns_note = status.get("userns", "")
            if proc is None:  # a user namespace it could not use: start again without one
                proc, status = self._start(argv, env, confine.Plan(-1, False, rlimits, ruleset, not self.policy.unix_sockets),
                                           streams)
        finally:
            if ruleset is not None:
                ruleset.close()
        assert proc is not None
        isolation = self._isolation(status, userns_note, ruleset, abi, no_landlock, limit_text, withheld)
        _warn_once(isolation)
        return proc, isolation

    def _start(self, argv: list[str], env: dict[str, str], plan: confine.Plan,
               streams: tuple[int | None, Any]) -> tuple[subprocess.Popen[str] | None, dict[str, str]]:
        """(the child, its status lines), or (None, status) when its user namespace was unusable. `streams`: its stdin
        and stderr (stdout is a pipe)."""
        r, w = os.pipe()
        try:
            try:
                proc = subprocess.Popen(argv, cwd=self.workdir, env=env, stdin=streams[0], stdout=subprocess.PIPE,
                                        stderr=streams[1], text=True, start_new_session=True,
                                        preexec_fn=confine.preexec(replace(plan, status_fd=w)))
            finally:
                os.close(w)
        except subprocess.SubprocessError:  # raised in the child before its exec: confine.preexec
            status = _read_status(r)
            if plan.new_netns and "userns" in status:
                return None, status
            raise
        except BaseException:
            os.close(r)
            raise
        return proc, _read_status(r)

    def _isolation(self, status: Mapping[str, str], userns_note: str, ruleset: Ruleset | None,
                   abi: int, no_landlock: str, limits: tuple[str, ...], withheld: tuple[str, ...]) -> Isolation:
        missing = []
        fs_reason = status.get("fs", no_landlock) if ruleset is not None else no_landlock
        landlock_on = ruleset is not None and fs_reason == ""
        if self.policy.network:
            network = "allowed"
        elif status.get("net") == "":
            network = "namespace"
        else:
            why = status.get("net") or userns_note or "not attempted"
            network = "tcp-denied" if landlock_on and ruleset is not None and ruleset.tcp_denied else "open"
            rest = ("TCP denied by Landlock; UDP open" if network == "tcp-denied" else
                    "it can open any network connection the user can")
            missing.append(f"no network namespace ({why}): {rest}")
        if self.policy.unix_sockets:
            unix = "allowed"
        elif status.get("unix") == "":
            unix = "blocked"
        else:
            unix = "open"
            missing.append(f"Unix-domain sockets open ({status.get('unix', 'not attempted')}): it can reach local services "
                           "through their socket files (session bus, Docker, ssh-agent, a local PostgreSQL)")
        if not landlock_on:
            missing.append(f"no read-only view ({fs_reason}): it can read the user's files and write wherever the user can")
        if status.get("caps") == "":
            limits = (*limits, "no capabilities")
        elif os.geteuid() == 0:
            missing.append(f"root's capabilities kept ({status.get('caps')})")
        return Isolation(withheld_env=withheld, workdir=str(self.workdir), network=network, unix_sockets=unix,
                         filesystem="landlock" if landlock_on else "open", landlock_abi=abi,
                         signals_scoped=landlock_on and ruleset is not None and ruleset.scoped, limits=limits,
                         missing=tuple(missing))


def _read_status(r: int) -> dict[str, str]:
    """The child's status lines, then close `r`. They are all there: the child writes them in one write before its
    exec, and Popen returns after the exec. Not read to EOF, which a fork elsewhere in this process could delay."""
    os.set_blocking(r, False)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(r, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
    return confine.parse_status(b"".join(chunks).decode(errors="replace"))


def _warn_once(isolation: Isolation) -> None:
    if isolation.missing and isolation.missing not in _warned:
        _warned.add(isolation.missing)
        log.warning("sandbox: candidate code runs with less isolation than asked: %s", "; ".join(isolation.missing))


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child's process group (the child, its reaper, whatever they started) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group outlives a child that already exited, until its last member
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
