"""Run the child in a sandbox with a timeout; turn its fate into a result.

The child (`python -m verify.child`) runs in a `verify.sandbox.Sandbox`: a fresh interpreter with a scrubbed
environment, its own directory (the request, result and progress files live there), no network where the OS
allows a namespace, resource limits (RLIMIT_AS on CPU only: a CUDA context reserves far more virtual address
space than it uses), a Landlock view (the spec's and candidate's directories readable, nothing writable
outside its directory and the sandbox's compiler caches), and TRITON_INTERPRET=1 on CPU. A crash, a signal or
a hang becomes a runtime_error or timeout verdict, never a harness crash; `result.isolation` says what was in force.

The child never outlives this call: its process group is SIGKILLed on every way out (result, timeout,
exception, KeyboardInterrupt, SIGTERM that the CLI maps to one), and PR_SET_PDEATHSIG (SIGKILL) kills it if
this process dies without running that code (SIGKILL); the child's own reaper then kills the rest of its
group (see `verify.child`). The directory is named `kb-verify-PID-START-…` after its owner
(`kb.procs.owned_prefix`), so `kb doctor` can remove one whose owner was killed before it could.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path

from kb.errors import KBError
from verify.options import VerifyOptions
from verify.result import Finding, Verdict, VerifyResult
from verify.sandbox import Sandbox, SandboxPolicy

__all__ = ["run_child", "resolve_device", "child_policy"]

log = logging.getLogger(__name__)


def resolve_device(opts: VerifyOptions) -> str:
    if opts.device != "auto":
        return opts.device
    import torch  # noqa: PLC0415  deferred: the CLI should not pay for torch before it needs it

    return "cuda" if torch.cuda.is_available() else "cpu"


def child_policy(spec: Path, candidate: Path, opts: VerifyOptions, device: str,
                 base: SandboxPolicy | None = None) -> SandboxPolicy:
    """`base` (default: SandboxPolicy()) plus what this verification needs: the spec's and candidate's files and
    directories readable (the candidate may import its siblings), the memory limit on CPU, the Triton interpreter."""
    base = base or SandboxPolicy()
    files = (spec.resolve(), spec.resolve().parent, candidate.resolve(), candidate.resolve().parent)
    set_env = {**base.set_env, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    return replace(base, readable=(*base.readable, *files), set_env=set_env,
                   memory_limit_mib=opts.memory_limit_mib if device == "cpu" else base.memory_limit_mib)


def run_child(spec: Path, candidate: Path, opts: VerifyOptions, sandbox: SandboxPolicy | None = None) -> VerifyResult:
    device = resolve_device(opts)
    with Sandbox(child_policy(spec, candidate, opts, device, sandbox)) as box:
        req, out, progress = box.workdir / "request.json", box.workdir / "result.json", box.workdir / "progress.txt"
        req.write_text(json.dumps({"spec": str(spec.resolve()), "candidate": str(candidate.resolve()),
                                   "options": {**opts.to_dict(), "device": device}}))
        start = time.monotonic()
        run = box.run("verify.child", [str(req), str(out), str(progress)], timeout_s=opts.timeout_s)
        elapsed = time.monotonic() - start
        if run.timed_out:
            where = progress.read_text() if progress.exists() else "before the first call"
            res = _failed(Verdict.timeout, f"no result within {round(opts.timeout_s, 1):g}s (in flight: {where})", spec,
                          candidate, opts, device, elapsed, "")
        else:
            assert run.returncode is not None
            res = _collect(run.returncode, run.stderr, out, progress, spec, candidate, opts, device, elapsed)
        return replace(res, isolation=run.isolation)


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
    elif code == -signal.SIGXCPU:
        how += " (CPU time limit)"
    elif code == -signal.SIGXFSZ:
        how += " (file size limit)"
    return _failed(Verdict.runtime_error, f"candidate process {how} (in flight: {where})", spec, candidate, opts,
                   device, elapsed, stderr[-4000:])


def _failed(verdict: Verdict, message: str, spec: Path, candidate: Path, opts: VerifyOptions, device: str,
            elapsed: float, detail: str) -> VerifyResult:
    return VerifyResult(verdict=verdict, message=message, spec=str(spec), candidate=str(candidate),
                        seed=opts.seed if opts.seed is not None else -1, torch_baseline=opts.torch_baseline,
                        device=device, finding=Finding(verdict, message, detail=detail), duration_s=elapsed,
                        score=0.2 if verdict is Verdict.runtime_error or verdict is Verdict.timeout else 0.0)
