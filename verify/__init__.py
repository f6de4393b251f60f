"""The verification harness: `verify(spec, candidate, options) -> VerifyResult`.

Every candidate runs in a sandboxed child process (see `verify.runner`, `verify.sandbox`); user mistakes in the spec
or the spec/candidate pairing raise `kb.errors.KBError`; everything a candidate does
wrong is a `Verdict`.
"""

from __future__ import annotations

from pathlib import Path

from verify.options import ALL_DISTRIBUTIONS, VerifyOptions
from verify.result import Finding, MemoryReport, ShapeCase, TimingReport, Verdict, VerifyResult
from verify.runner import run_child
from verify.sandbox import Isolation, SandboxPolicy

__all__ = ["verify", "VerifyOptions", "VerifyResult", "Verdict", "Finding", "ShapeCase", "MemoryReport",
           "TimingReport", "ALL_DISTRIBUTIONS", "SandboxPolicy", "Isolation"]


def verify(spec_path: Path | str, candidate_path: Path | str, options: VerifyOptions | None = None,
           sandbox: SandboxPolicy | None = None) -> VerifyResult:
    """Check `candidate_path` (ModelNew) against `spec_path` (Model) in a sandboxed subprocess.

    `sandbox` adds to the default confinement (e.g. `SandboxPolicy(hidden=(kb_home,))`); it cannot remove the
    built-in parts (scrubbed environment, hidden home and KB home)."""
    return run_child(Path(spec_path), Path(candidate_path), options or VerifyOptions(), sandbox)
