"""The knowledge-base tables (SQLModel over SQLite or PostgreSQL).

Invariants:
- Every id is derived by `kb.store.records.assign_id` from the identifying
  fields (see `kb.store.ids`); callers may leave `id` empty.
- Datetimes are timezone-aware (UTC); SQLModel refuses naive ones.
- `*_json` columns hold JSON text: objects (features, params, designs, shapes; `kb.store.rules` says
  which keys and types).
- Enum-valued columns are plain strings holding an Enum's value; `kb.store.rules`
  checks them, so a row that breaks a rule never reaches the database.
- `quarantine` (kernels, snippets, tunables, perf records, lessons): empty for a row in use; else why
  `kb doctor --fix` set it aside (a row stored by an older kernel-kb or by hand that breaks a rule).
  Nothing reads a quarantined row for generation or retrieval; it keeps its id, its links and its data.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum

from sqlmodel import Field, SQLModel

__all__ = [
    "SCHEMA_VERSION",
    "SourceKind",
    "Origin",
    "PerfKind",
    "RunStatus",
    "Meta",
    "Source",
    "Kernel",
    "Snippet",
    "Tunable",
    "PerfRecord",
    "GenerationRun",
    "Attempt",
    "Lesson",
    "TABLES",
    "TABLE_BY_NAME",
    "QUARANTINABLE",
    "utcnow",
]

# Bump when a table changes; add a step to `kb.store.db.MIGRATIONS` at the same time.
# 2: perf_records.arch and perf_records.design_json (which design of a kernel was measured, on which arch)
# 3: `quarantine` on kernels, snippets, tunables, perf_records and lessons (rows `kb doctor --fix` set aside)
SCHEMA_VERSION = 3


def utcnow() -> datetime:
    return datetime.now(UTC)


class SourceKind(StrEnum):
    SDIST = "sdist"
    WHEEL = "wheel"
    LOCAL = "local"


class Origin(StrEnum):
    INGEST = "ingest"
    GENERATED = "generated"


class PerfKind(StrEnum):
    MEASURED = "measured"  # run by us: gpu, driver, versions, command, date
    REPORTED = "reported"  # quoted from elsewhere: citation


class RunStatus(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # stopped by Ctrl-C / SIGTERM, or found dead by `kb doctor`


class Meta(SQLModel, table=True):
    """Key/value facts about the database itself (schema_version)."""

    __tablename__ = "kb_meta"
    key: str = Field(primary_key=True)
    value: str


class Source(SQLModel, table=True):
    """A pinned expert release (or a local tree) that artefacts were lifted from."""

    __tablename__ = "sources"
    id: str = Field(default="", primary_key=True)
    distribution: str = Field(index=True)
    version: str = ""
    kind: str = SourceKind.SDIST.value
    filename: str = ""
    sha256: str = ""
    fetched_at: datetime = Field(default_factory=utcnow)


class Kernel(SQLModel, table=True):
    """A complete IR program: lifted from an expert source or generated from a spec."""

    __tablename__ = "kernels"
    id: str = Field(default="", primary_key=True)
    name: str = ""
    family: str = Field(default="", index=True)
    origin: str = Origin.INGEST.value
    ir_text: str
    content_hash: str = ""  # sha256(ir_text); filled by the store when empty
    features_json: str = "{}"
    arch: str = Field(default="any", index=True)
    dtype: str = Field(default="", index=True)
    head_dim: int | None = Field(default=None, index=True)
    source_id: str | None = Field(default=None, foreign_key="sources.id")
    file: str = ""
    line_start: int | None = None
    line_end: int | None = None
    lifter_version: str = ""
    verified: bool = False
    verify_note: str = ""
    parent_id: str | None = Field(default=None, foreign_key="kernels.id", index=True)  # lineage
    spec_hash: str = ""
    triton_src: str = ""
    cuda_src: str = ""
    created_at: datetime = Field(default_factory=utcnow)
    quarantine: str = ""  # why `kb doctor --fix` set this row aside; empty: in use


class Snippet(SQLModel, table=True):
    """A region of an expert source with its IR meaning (mask, softmax rescale, epilogue...).

    `text` is the excerpt of the downloaded source: it is stored only in the user's
    own KB and never committed to this repository.
    """

    __tablename__ = "snippets"
    id: str = Field(default="", primary_key=True)
    kind: str = Field(index=True)
    title: str = ""
    ir_text: str = ""
    text: str = ""
    features_json: str = "{}"
    source_id: str | None = Field(default=None, foreign_key="sources.id")
    kernel_id: str | None = Field(default=None, foreign_key="kernels.id", index=True)
    file: str = ""
    line_start: int | None = None
    line_end: int | None = None
    lifter_version: str = ""
    quarantine: str = ""  # why `kb doctor --fix` set this row aside; empty: in use


class Tunable(SQLModel, table=True):
    """A launch configuration chosen by an expert source for a head dim / arch / dtype."""

    __tablename__ = "tunables"
    id: str = Field(default="", primary_key=True)
    source_id: str | None = Field(default=None, foreign_key="sources.id")
    family: str = Field(default="", index=True)
    arch: str = "any"
    head_dim: int | None = None
    dtype: str = ""
    params_json: str = "{}"
    condition: str = ""
    file: str = ""
    line_start: int | None = None
    line_end: int | None = None
    quarantine: str = ""  # why `kb doctor --fix` set this row aside; empty: in use


class PerfRecord(SQLModel, table=True):
    """One performance number, either `measured` by us or `reported` with a citation; never both."""

    __tablename__ = "perf_records"
    id: str = Field(default="", primary_key=True)
    kernel_id: str = Field(foreign_key="kernels.id", index=True)
    kind: str
    gpu: str = ""
    driver: str = ""
    torch_version: str = ""
    triton_version: str = ""
    shape_json: str = "{}"
    dtype: str = ""
    ms: float | None = None
    tflops: float | None = None
    command: str = ""
    measured_at: datetime | None = None
    citation: str = ""
    notes: str = ""
    arch: str = Field(default="", index=True)  # sm90, sm80, ...: the target the measured design ran on
    design_json: str = "{}"  # kb.ir.design.Design.to_dict() of what was timed; {} when not recorded
    quarantine: str = ""  # why `kb doctor --fix` set this row aside; empty: in use


class GenerationRun(SQLModel, table=True):
    """One `kb generate` run for one spec."""

    __tablename__ = "generation_runs"
    id: str = Field(default="", primary_key=True)
    spec_path: str = ""
    spec_hash: str = Field(default="", index=True)
    engine: str = ""
    memory: bool = True
    status: str = RunStatus.RUNNING.value
    error: str = ""  # the failure; while `running`, the owner process (kb.procs.Owner.note) for `kb doctor`
    kernel_id: str | None = Field(default=None, foreign_key="kernels.id")
    started_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None


class Attempt(SQLModel, table=True):
    """Attempt `n` of a run: the IR it proposed and what verification said."""

    __tablename__ = "attempts"
    id: str = Field(default="", primary_key=True)
    run_id: str = Field(foreign_key="generation_runs.id", index=True)
    n: int
    reference_id: str | None = Field(default=None, foreign_key="kernels.id")
    ir_text: str = ""
    verdict: str = ""
    feedback: str = ""
    duration_s: float | None = None


class Lesson(SQLModel, table=True):
    """Something a run learned (what failed and what fixed it), retrieved by later runs."""

    __tablename__ = "lessons"
    id: str = Field(default="", primary_key=True)
    run_id: str | None = Field(default=None, foreign_key="generation_runs.id")
    kind: str = ""
    text: str
    features_json: str = "{}"
    created_at: datetime = Field(default_factory=utcnow)
    quarantine: str = ""  # why `kb doctor --fix` set this row aside; empty: in use


# Dependency order: a table only references tables before it (kernels also reference
# themselves through parent_id; export/import order kernels parent-first).
TABLES: tuple[type[SQLModel], ...] = (
    Source,
    Kernel,
    Snippet,
    Tunable,
    PerfRecord,
    GenerationRun,
    Attempt,
    Lesson,
)
# name -> table, in TABLES' order
TABLE_BY_NAME: dict[str, type[SQLModel]] = {m.__tablename__: m for m in TABLES}  # type: ignore[misc]
# the tables whose rows `kb doctor --fix` may quarantine (they carry a `quarantine` column)
QUARANTINABLE: tuple[type[SQLModel], ...] = (Kernel, Snippet, Tunable, PerfRecord, Lesson)
