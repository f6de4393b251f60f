"""Run the child in a subprocess with a timeout and a memory limit; turn its fate into a result.

The child gets a fresh interpreter (`python -m verify.child`), its own process group (so a
hang is killed with everything it started), RLIMIT_AS on CPU (not on CUDA, whose context
reserves far more virtual address space than it uses), and TRITON_INTERPRET=1 on CPU.
A crash, a signal or a hang becomes a runtime_error or timeout verdict, never a harness crash.

The child never outlives this call: its process group is SIGKILLed in a `finally` on every
way out (result, timeout, exception, KeyboardInterrupt, SIGTERM that the CLI maps to one),
and PR_SET_PDEATHSIG (SIGKILL) kills it if this process dies without running that `finally`
(SIGKILL); the child's own reaper then kills the rest of its group (see `verify.child`).
The temp directory is named `kb-verify-PID-START-…` after its owner (`kb.procs.owned_prefix`), so
`kb doctor` can remove one whose owner was killed before it could.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kb.errors import KBError
from kb.procs import die_with_parent, owned_prefix
from verify.options import VerifyOptions
from verify.result import Finding, Verdict, VerifyResult

__all__ = ["run_child", "resolve_device"]

log = logging.getLogger(__name__)


def resolve_device(opts: VerifyOptions) -> str:
    if opts.device != "auto":
        return opts.device
    import torch  # deferred: the CLI should not pay for torch before it needs it

    return "cuda" if torch.cuda.is_available() else "cpu"


def _prepare(memory_limit_mib: int | None) -> Callable[[], None]:
    """The child's preexec_fn: die with this process (SIGKILL), and on CPU cap the address space."""
    arm = die_with_parent(signal.SIGKILL)

    def apply() -> None:
        arm()
        if memory_limit_mib is not None:
            nbytes = memory_limit_mib * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))

    return apply


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (the child, its reaper, whatever they started) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group outlives a child that already exited, until its last member
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def run_child(spec: Path, candidate: Path, opts: VerifyOptions) -> VerifyResult:
    device = resolve_device(opts)
    with tempfile.TemporaryDirectory(prefix=owned_prefix()) as tmp:
        req, out, progress = Path(tmp, "request.json"), Path(tmp, "result.json"), Path(tmp, "progress.txt")
        req.write_text(json.dumps({"spec": str(spec.resolve()), "candidate": str(candidate.resolve()),
                                   "options": {**opts.to_dict(), "device": device}}))
        env = dict(os.environ)
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "verify.child", str(req), str(out), str(progress)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=_prepare(opts.memory_limit_mib if device == "cpu" else None))
        try:
            try:
                _, stderr = proc.communicate(timeout=opts.timeout_s)
            except subprocess.TimeoutExpired:
                where = progress.read_text() if progress.exists() else "before the first call"
                return _failed(Verdict.timeout, f"no result within {round(opts.timeout_s, 1):g}s (in flight: {where})", spec, candidate,
                               opts, device, time.monotonic() - start, "")
            return _collect(proc.returncode, stderr, out, progress, spec, candidate, opts, device, time.monotonic() - start)
        finally:
            _kill_group(proc)


def _collect(code: int, stderr: str, out: Path, progress: Path, spec: Path, candidate: Path, opts: VerifyOptions,
             device: str, elapsed: float) -> VerifyResult:
    if out.exists():
        payload = json.loads(out.read_text())
        if "user_error" in payload:
            raise KBError(payload["user_error"])
        return VerifyResult.from_dict(payload["result"])
    where = progress.read_text() if progress.exists() else "before the first call"
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    if "MemoryError" in stderr or "std::bad_alloc" in stderr:
        how += f" (memory limit {opts.memory_limit_mib} MiB)"
    return _failed(Verdict.runtime_error, f"candidate process {how} (in flight: {where})", spec, candidate, opts,
                   device, elapsed, stderr[-4000:])


def _failed(verdict: Verdict, message: str, spec: Path, candidate: Path, opts: VerifyOptions, device: str,
            elapsed: float, detail: str) -> VerifyResult:
    return VerifyResult(verdict=verdict, message=message, spec=str(spec), candidate=str(candidate),
                        seed=opts.seed if opts.seed is not None else -1, torch_baseline=opts.torch_baseline,
                        device=device, finding=Finding(verdict, message, detail=detail), duration_s=elapsed,
                        score=0.2 if verdict is Verdict.runtime_error or verdict is Verdict.timeout else 0.0)
