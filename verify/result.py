"""Typed results of a verification run.

Invariants: `VerifyResult.verdict is Verdict.passed` exactly when `finding is None`;
every non-passing verdict carries one `Finding` with the evidence (which shape,
distribution and seed, the forbidden op, the error sizes). Results round-trip
through JSON (`to_json` / `from_json`) because the child process reports in JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any

from verify.sandbox import Isolation

__all__ = ["Verdict", "ShapeCase", "Finding", "MemoryReport", "TimingReport", "BackwardReport", "VerifyResult"]


class Verdict(str, Enum):
    compile_error = "compile_error"
    runtime_error = "runtime_error"
    timeout = "timeout"
    shape_mismatch = "shape_mismatch"
    numeric_mismatch = "numeric_mismatch"
    nondeterministic = "nondeterministic"
    forbidden_call = "forbidden_call"
    hack_suspected = "hack_suspected"
    no_backward = "no_backward"  # backward runs only: output detached from autograd, backward not implemented, a gradient missing
    passed = "passed"
    not_run = "not_run"  # never a verify result: `kb generate --no-verify` records a kernel it did not verify


@dataclass(frozen=True)
class ShapeCase:
    """One attention shape: q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv]; `origin` says why it was chosen."""

    B: int
    Hq: int
    Hkv: int
    Sq: int
    Skv: int
    D: int
    dtype: str
    origin: str = "spec"
    Dv: int = 0  # v's head dim; 0 = D

    def __post_init__(self) -> None:
        if not self.Dv:
            object.__setattr__(self, "Dv", self.D)

    def label(self) -> str:
        dv = f" Dv{self.Dv}" if self.Dv != self.D else ""
        return f"B{self.B} H{self.Hq}/{self.Hkv} Sq{self.Sq} Skv{self.Skv} D{self.D}{dv} {self.dtype}"


@dataclass(frozen=True)
class Finding:
    """Why a run did not pass, with the evidence a reader needs to reproduce it."""

    verdict: Verdict
    message: str
    case: ShapeCase | None = None
    distribution: str | None = None
    seed: int | None = None
    op: str | None = None  # forbidden op or hack name
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    detail: str = ""  # traceback tail, stderr tail, source line
    phase: str = "forward"  # "forward" or "backward": which pass was caught
    grad: str | None = None  # backward: the gradient at fault ("q", "k", "v", "param rel_bias")


@dataclass(frozen=True)
class MemoryReport:
    """Peak memory above the pre-call level, in MiB; `method` says how it was measured."""

    candidate_peak_mib: float
    reference_peak_mib: float
    method: str


@dataclass(frozen=True)
class TimingReport:
    """GPU timings in ms (None on CPU: 'not timed') and the composite score of DESIGN.md."""

    timed: bool
    reason: str = ""
    candidate_ms: float | None = None
    candidate_iqr_ms: float | None = None
    baseline_ms: float | None = None
    baseline_iqr_ms: float | None = None
    limit_ms: float | None = None
    speedup: float | None = None
    perf_term: float | None = None


@dataclass(frozen=True)
class BackwardReport:
    """What a `backward=True` run checked: which gradients, on how many calls, and how far off they were.

    Errors are the largest over all calls and gradients, each in units of its gradient's
    max(1, max |ref|); `max_torch_err` is the same measure for eager torch emulated in the spec's
    dtype, the basis of the tolerance (see verify.grads; 0 for fp32 specs)."""

    calls: int
    grads: tuple[str, ...]
    max_abs_err: float
    max_torch_err: float
    slack: float


@dataclass(frozen=True)
class VerifyResult:
    verdict: Verdict
    message: str
    spec: str
    candidate: str
    seed: int
    torch_baseline: bool
    device: str
    finding: Finding | None = None
    cases: tuple[ShapeCase, ...] = ()
    distributions: tuple[str, ...] = ()
    calls: int = 0
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    memory: MemoryReport | None = None
    timing: TimingReport | None = None
    score: float = 0.0
    notes: tuple[str, ...] = ()
    duration_s: float = 0.0
    backward: BackwardReport | None = None  # None: gradients were not checked
    isolation: Isolation | None = None  # what confined the candidate (verify.sandbox); None: run in this process

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.passed

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=_enum_value))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VerifyResult":
        kw = dict(data)
        kw["verdict"] = Verdict(kw["verdict"])
        kw["finding"] = _finding(kw.get("finding"))
        kw["cases"] = tuple(ShapeCase(**c) for c in kw.get("cases", ()))
        kw["distributions"] = tuple(kw.get("distributions", ()))
        kw["notes"] = tuple(kw.get("notes", ()))
        kw["memory"] = MemoryReport(**kw["memory"]) if kw.get("memory") else None
        kw["timing"] = TimingReport(**kw["timing"]) if kw.get("timing") else None
        bwd = kw.get("backward")
        kw["backward"] = BackwardReport(**{**bwd, "grads": tuple(bwd["grads"])}) if bwd else None
        kw["isolation"] = Isolation.from_dict(kw["isolation"]) if kw.get("isolation") else None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kw.items() if k in known})

    @classmethod
    def from_json(cls, text: str) -> "VerifyResult":
        return cls.from_dict(json.loads(text))


def _finding(data: dict[str, Any] | None) -> Finding | None:
    if not data:
        return None
    kw = dict(data)
    kw["verdict"] = Verdict(kw["verdict"])
    kw["case"] = ShapeCase(**kw["case"]) if kw.get("case") else None
    return Finding(**kw)


def _enum_value(obj: object) -> object:
    if isinstance(obj, Enum):
        return obj.value
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
