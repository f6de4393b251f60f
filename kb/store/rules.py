"""Validation rules for records, kept as a table apart from construction.

SQLModel table classes do not validate on construction, so every write path
(`KnowledgeBase.write_*`, `import_jsonl`, `kb perf import`) calls `check(record)`; a record that
breaks a rule raises `KBError` naming the record and every broken rule. Rows already stored
(by an older kernel-kb, or by hand) are checked again where they are read for generation
(`KnowledgeBase.usable`) and by `kb doctor`, which quarantines those that break a rule.

A rule is (description, test): the test returns True when the row keeps it, else False or a
string saying what is wrong. Besides the table, every int column fits a signed 64-bit column,
every float is finite, and every datetime is timezone-aware. The JSON columns have typed rules
of their own (`kb.store.payloads`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from sqlmodel import SQLModel

from kb.errors import KBError
from kb.store.ids import kernel_id, sha256_text
from kb.store.payloads import MAX_HEAD_DIM, design_problems, features_problems, is_int, params_problems, shape_problems
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
# (description, test) pairs over rows of one table; `Rules[Kernel]` lets the checker see each lambda's columns.
# A test returns True (kept) or False / a string saying what is wrong (broken).
Rules = tuple[tuple[str, Callable[[R], "bool | str"]], ...]
INT64 = 2**63


def _typed(problems: list[str]) -> bool | str:
    return "; ".join(problems) if problems else True


def _head_dim_ok(v: int | None) -> bool:
    return v is None or (is_int(v) and 0 <= v <= MAX_HEAD_DIM)


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
    ("id is k- + the first 16 hex digits of content_hash", lambda r: not r.id or r.id == kernel_id(r.content_hash)),
    ("features_json holds typed features", lambda r: _typed(features_problems(r.features_json))),
    (f"head_dim is empty or in [0, {MAX_HEAD_DIM}] (0: unknown)", lambda r: _head_dim_ok(r.head_dim)),
    ("line_start <= line_end", _span_ok),
    ("a kernel is not its own parent", lambda r: r.parent_id is None or r.parent_id != r.id),
)

_SNIPPET: Rules[Snippet] = (
    ("kind is required", lambda r: bool(r.kind)),
    ("ir_text or text is required", lambda r: bool(r.ir_text or r.text)),
    ("features_json holds typed features", lambda r: _typed(features_problems(r.features_json))),
    ("line_start <= line_end", _span_ok),
)

_TUNABLE: Rules[Tunable] = (
    ("params_json holds typed launch parameters", lambda r: _typed(params_problems(r.params_json))),
    (f"head_dim is empty or in [0, {MAX_HEAD_DIM}] (0: any)", lambda r: _head_dim_ok(r.head_dim)),
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
    ("shape_json is an object whose dimensions are positive ints", lambda r: _typed(shape_problems(r.shape_json))),
    ("design_json is {}, a .cu record or a valid design", lambda r: _typed(design_problems(r.design_json))),
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
    ("features_json holds typed features", lambda r: _typed(features_problems(r.features_json))),
)

RULES: dict[type[SQLModel], Rules[Any]] = {
    Source: _SOURCE, Kernel: _KERNEL, Snippet: _SNIPPET, Tunable: _TUNABLE, PerfRecord: _PERF, GenerationRun: _RUN,
    Attempt: _ATTEMPT, Lesson: _LESSON,
}


def _column_values(record: SQLModel, stored: bool) -> list[str]:
    """Rules every table shares: datetimes are timezone-aware (when written), ints fit 64 bits, floats are finite."""
    out = []
    for name in type(record).model_fields:
        v = getattr(record, name)
        if isinstance(v, datetime) and v.utcoffset() is None and not stored:
            out.append(f"{name} is timezone-aware (use datetime.now(UTC))")
        elif isinstance(v, int) and not isinstance(v, bool) and not -INT64 <= v < INT64:
            out.append(f"{name} fits a signed 64-bit integer")
        elif isinstance(v, float) and not math.isfinite(v):
            out.append(f"{name} is a finite number")
    return out


def violations(record: SQLModel, *, stored: bool = False) -> list[str]:
    """The descriptions of every rule `record` breaks (empty when it is valid). `stored`: a row read back from the
    database, whose datetimes the database returns without their (UTC) offset."""
    out = _column_values(record, stored)
    for desc, test in RULES[type(record)]:
        try:
            got = test(record)
        except (TypeError, ValueError, AttributeError):  # a column of the wrong type, e.g. a str where an int belongs
            got = False
        if got is not True:
            out.append(desc if got is False else f"{desc} ({got})")
    return out


def check(record: SQLModel) -> None:
    """Raise `KBError` if `record` breaks any rule."""
    broken = violations(record)
    if broken:
        label = getattr(record, "id", "") or type(record).__name__
        raise KBError(f"invalid {type(record).__name__} {label}: " + "; ".join(broken))
