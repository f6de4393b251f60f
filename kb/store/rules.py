"""Validation rules for records, kept as a table apart from construction.

SQLModel table classes do not validate on construction, so every write path
(`KnowledgeBase.write_*`, `import_jsonl`) calls `check(record)`; a record that
breaks a rule raises `KBError` naming the record and every broken rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from sqlmodel import SQLModel

from kb.errors import KBError
from kb.store.ids import sha256_text
from kb.store.models import (
    Attempt,
    GenerationRun,
    Kernel,
    Lesson,
    Origin,
    PerfKind,
    PerfRecord,
    RunStatus,
    Snippet,
    Source,
    SourceKind,
    Tunable,
)

__all__ = ["RULES", "violations", "check"]

R = TypeVar("R", bound=SQLModel)
# (description, test) pairs over rows of one table; `Rules[Kernel]` lets the checker see each lambda's columns
Rules = tuple[tuple[str, Callable[[R], bool]], ...]


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


def _json_any(text: str) -> bool:
    try:
        json.loads(text)
    except (TypeError, ValueError):
        return False
    return True


def _span_ok(r: SQLModel) -> bool:
    a, b = getattr(r, "line_start"), getattr(r, "line_end")
    return a is None or b is None or 0 < a <= b


_MEASURED_NEEDS = ("gpu", "ms", "command", "measured_at")

_SOURCE: Rules[Source] = (
    ("distribution is required", lambda r: bool(r.distribution)),
    (f"kind is one of {[k.value for k in SourceKind]}", lambda r: r.kind in set(SourceKind)),
)

_KERNEL: Rules[Kernel] = (
    ("ir_text is required", lambda r: bool(r.ir_text)),
    (f"origin is one of {[o.value for o in Origin]}", lambda r: r.origin in set(Origin)),
    ("content_hash is sha256(ir_text)", lambda r: r.content_hash == sha256_text(r.ir_text)),
    ("features_json is a JSON object", lambda r: _json_object(r.features_json)),
    ("line_start <= line_end", _span_ok),
    ("a kernel is not its own parent", lambda r: r.parent_id is None or r.parent_id != r.id),
)

_SNIPPET: Rules[Snippet] = (
    ("kind is required", lambda r: bool(r.kind)),
    ("ir_text or text is required", lambda r: bool(r.ir_text or r.text)),
    ("features_json is a JSON object", lambda r: _json_object(r.features_json)),
    ("line_start <= line_end", _span_ok),
)

_TUNABLE: Rules[Tunable] = (
    ("params_json is a JSON object", lambda r: _json_object(r.params_json)),
    ("line_start <= line_end", _span_ok),
)

_PERF: Rules[PerfRecord] = (
    ("kernel_id is required", lambda r: bool(r.kernel_id)),
    (f"kind is one of {[k.value for k in PerfKind]}", lambda r: r.kind in set(PerfKind)),
    (
        "a measured record needs gpu, ms, command and measured_at",
        lambda r: r.kind != PerfKind.MEASURED or all(getattr(r, f) not in (None, "") for f in _MEASURED_NEEDS),
    ),
    ("a measured record has no citation", lambda r: r.kind != PerfKind.MEASURED or not r.citation),
    ("a reported record needs a citation", lambda r: r.kind != PerfKind.REPORTED or bool(r.citation)),
    (
        "a reported record has no measurement provenance (gpu driver command measured_at)",
        lambda r: r.kind != PerfKind.REPORTED or not (r.driver or r.command or r.measured_at),
    ),
    ("ms and tflops are positive", lambda r: all(v is None or v > 0 for v in (r.ms, r.tflops))),
    ("shape_json is JSON", lambda r: _json_any(r.shape_json)),
    ("design_json is a JSON object", lambda r: _json_object(r.design_json)),
    ("a measured design names its arch", lambda r: r.design_json in ("{}", "") or bool(r.arch)),
)

_RUN: Rules[GenerationRun] = (
    (f"status is one of {[s.value for s in RunStatus]}", lambda r: r.status in set(RunStatus)),
)

_ATTEMPT: Rules[Attempt] = (
    ("run_id is required", lambda r: bool(r.run_id)),
    ("n >= 1", lambda r: r.n is not None and r.n >= 1),
)

_LESSON: Rules[Lesson] = (
    ("text is required", lambda r: bool(r.text)),
    ("features_json is a JSON object", lambda r: _json_object(r.features_json)),
)

RULES: dict[type[SQLModel], Rules[Any]] = {
    Source: _SOURCE, Kernel: _KERNEL, Snippet: _SNIPPET, Tunable: _TUNABLE, PerfRecord: _PERF, GenerationRun: _RUN,
    Attempt: _ATTEMPT, Lesson: _LESSON,
}


def _naive_datetimes(record: SQLModel) -> list[str]:
    return [
        f"{name} is timezone-aware (use datetime.now(UTC))"
        for name in type(record).model_fields
        if isinstance(v := getattr(record, name), datetime) and v.utcoffset() is None
    ]


def violations(record: SQLModel) -> list[str]:
    """The descriptions of every rule `record` breaks (empty when it is valid)."""
    return [desc for desc, ok in RULES[type(record)] if not ok(record)] + _naive_datetimes(record)


def check(record: SQLModel) -> None:
    """Raise `KBError` if `record` breaks any rule."""
    broken = violations(record)
    if broken:
        label = getattr(record, "id", "") or type(record).__name__
        raise KBError(f"invalid {type(record).__name__} {label}: " + "; ".join(broken))
