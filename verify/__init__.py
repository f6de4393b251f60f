"""The verification harness: `verify(spec, candidate, options) -> VerifyResult`.

Every candidate runs in a child process (see `verify.runner`); user mistakes in the spec
or the spec/candidate pairing raise `kb.errors.KBError`; everything a candidate does
wrong is a `Verdict`.
"""

from __future__ import annotations

from pathlib import Path

from verify.options import ALL_DISTRIBUTIONS, VerifyOptions
from verify.result import Finding, MemoryReport, ShapeCase, TimingReport, Verdict, VerifyResult

__all__ = ["verify", "VerifyOptions", "VerifyResult", "Verdict", "Finding", "ShapeCase", "MemoryReport",
           "TimingReport", "ALL_DISTRIBUTIONS"]


def verify(spec_path: Path | str, candidate_path: Path | str, options: VerifyOptions | None = None) -> VerifyResult:
    """Check `candidate_path` (ModelNew) against `spec_path` (Model) in a subprocess."""
    from verify.runner import run_child

    return run_child(Path(spec_path), Path(candidate_path), options or VerifyOptions())
