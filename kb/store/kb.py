"""`KnowledgeBase`: the one object through which everything reads and writes the KB.

Write protocol (why a crash never loses committed rows or leaves a half-written kernel):
1. every SQL row of one logical write (a kernel with its snippets, tunables and perf
   records) goes into ONE transaction, upserted by content-hash id (idempotent);
2. only after the commit are the embedded rows (kernels, snippets, lessons) embedded
   and upserted into Chroma, skipping rows whose `doc_hash` Chroma already holds.
A kill between 1 and 2 leaves rows without embeddings, which `kb doctor --fix` embeds;
Chroma never holds an id before SQL does, so a crash cannot create orphans.

Read protocol for generation and retrieval: `usable` (and `skip_unusable`, `hit_rows`) leave out rows that
are quarantined or break a rule (a row an older kernel-kb or a hand wrote), with one warning per row per
process, so one bad record never stops `kb generate`; `kb doctor` reports such rows and `--fix` quarantines them.
"""

from __future__ import annotations

import builtins  # `list` below names the method KnowledgeBase.list
import fcntl
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from sqlalchemy import func
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, SQLModel, select

from kb.embed import Embedder, get_embedder
from kb.errors import KBError
from kb.settings import Settings
from kb.store import db, portable, writes
from kb.store.doctor import DoctorReport, run_doctor
from kb.store.ids import PREFIXES
from kb.store.models import (
    TABLE_BY_NAME,
    Attempt,
    GenerationRun,
    Kernel,
    Lesson,
    PerfRecord,
    RunStatus,
    Snippet,
    Source,
    Tunable,
    utcnow,
)
from kb.store.records import EMBEDDED, assign_id, redact_record
from kb.store.rules import check, violations
from kb.store.vectors import COLLECTIONS, VectorStore, open_vectors

__all__ = ["KernelBundle", "Counts", "KnowledgeBase", "open_kb"]

log = logging.getLogger(__name__)
R = TypeVar("R", bound=SQLModel)
_WARNED: set[str] = set()  # ids of stored rows already warned about in this process (`skip_unusable`)

@dataclass(frozen=True)
class KernelBundle:
    """A kernel and what is written with it, all or nothing."""

    kernel: Kernel
    snippets: Sequence[Snippet] = ()
    tunables: Sequence[Tunable] = ()
    perf: Sequence[PerfRecord] = ()


@dataclass(frozen=True)
class Counts:
    rows: Mapping[str, int] = field(default_factory=dict)  # table -> rows
    vectors: Mapping[str, int] = field(default_factory=dict)  # collection -> embeddings


class KnowledgeBase:
    """SQL rows (the truth) plus their Chroma embeddings. Use `open_kb` to get one."""

    def __init__(self, settings: Settings, engines: db.Engines, vectors: VectorStore, embedder: Embedder | None = None) -> None:
        self.settings = settings
        self.engines = engines
        self.vectors = vectors
        self._embedder = embedder

    # -- lifecycle -------------------------------------------------------------
    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = get_embedder(self.settings)
        return self._embedder

    def close(self) -> None:
        self.engines.dispose()

    def __enter__(self) -> KnowledgeBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def read_session(self) -> Iterator[Session]:
        with Session(self.engines.read, expire_on_commit=False) as s:
            yield s

    # -- writes ----------------------------------------------------------------
    def write_kernel(
        self,
        kernel: Kernel,
        snippets: Sequence[Snippet] = (),
        tunables: Sequence[Tunable] = (),
        perf: Sequence[PerfRecord] = (),
    ) -> str:
        """Write a kernel with its snippets/tunables/perf in one transaction; returns its id."""
        return self.write_kernels([KernelBundle(kernel, snippets, tunables, perf)])[0]

    def write_kernels(self, bundles: Iterable[KernelBundle], batch_size: int = 500) -> list[str]:
        """Write many bundles; each batch of `batch_size` bundles is one transaction."""
        out: list[str] = []
        batch: list[SQLModel] = []
        pending = 0
        for bundle in bundles:
            out.append(self._stage_bundle(bundle, batch))
            pending += 1
            if pending >= batch_size:
                self._write_rows(batch)
                batch, pending = [], 0
        if batch:
            self._write_rows(batch)
        return out

    def _stage_bundle(self, bundle: KernelBundle, into: list[SQLModel]) -> str:
        kernel = assign_id(bundle.kernel)
        into.append(kernel)
        for snip in bundle.snippets:
            if snip.kernel_id is None:
                snip.kernel_id = kernel.id
            into.append(assign_id(snip))
        into.extend(assign_id(t) for t in bundle.tunables)
        for p in bundle.perf:
            if not p.kernel_id:
                p.kernel_id = kernel.id
            into.append(assign_id(p))
        return kernel.id

    def write_source(self, source: Source) -> str:
        return self._write_rows([assign_id(source)])[0]

    def write_snippets(self, snippets: Sequence[Snippet]) -> list[str]:
        return self._write_rows([assign_id(s) for s in snippets])

    def write_tunables(self, tunables: Sequence[Tunable]) -> list[str]:
        return self._write_rows([assign_id(t) for t in tunables])

    def write_perf(self, records: Sequence[PerfRecord]) -> list[str]:
        return self._write_rows([assign_id(p) for p in records])

    def write_run(self, run: GenerationRun) -> str:
        """Insert a run, or update it (status, kernel_id, finished_at) when its id exists."""
        return self._write_rows([assign_id(run)])[0]

    def interrupt_run(self, run_id: str, why: str) -> bool:
        """Mark run `run_id` interrupted with `why` when it is still `running` (its process died or gave up without
        finishing it); False when it had finished, or is not in the KB."""
        run = self.find(run_id)
        if not isinstance(run, GenerationRun) or run.status != RunStatus.RUNNING.value:
            return False
        run.status, run.error, run.finished_at = RunStatus.INTERRUPTED.value, why, utcnow()
        self.write_run(run)
        return True

    def write_attempt(self, attempt: Attempt) -> str:
        return self._write_rows([assign_id(attempt)])[0]

    def write_lesson(self, lesson: Lesson) -> str:
        return self._write_rows([assign_id(lesson)])[0]

    def write_records(self, records: Sequence[SQLModel]) -> list[str]:
        """Write mixed records (e.g. a generated kernel, its run, attempts and lessons) in ONE transaction.

        Parents must precede children (kernel before run before attempts)."""
        return self._write_rows([assign_id(r) for r in records])

    def _write_rows(self, records: Sequence[SQLModel]) -> list[str]:
        """Validate, upsert all `records` in one transaction, then embed the embedded ones."""
        for r in records:
            redact_record(r)
            check(r)

        try:
            writes.commit_rows(self.engines, records)
        except IntegrityError as err:
            raise KBError(f"write rejected by the database: {err.orig}", hint="a referenced source/kernel/run id must be written first") from err
        writes.embed_rows(self, records)
        return [r.id for r in records]  # type: ignore[attr-defined]

    # -- reads -----------------------------------------------------------------
    def find(self, id_: str) -> SQLModel | None:
        """The record with this id from whichever table its prefix names, or None."""
        for prefix in sorted(PREFIXES, key=len, reverse=True):
            if id_.startswith(prefix):
                with self.read_session() as s:
                    return s.get(TABLE_BY_NAME[PREFIXES[prefix]], id_)
        return None

    def get(self, id_: str) -> SQLModel:
        """Like `find`, but an unknown id raises `KBError`."""
        rec = self.find(id_)
        if rec is None:
            raise KBError(f"no record with id {id_!r}", hint="ids look like k-…, s-…, src-…; see `kb stats` / `kb query`")
        return rec

    def get_row(self, table: type[R], id_: str) -> R:
        """Like `get`, for an id known to name a row of `table`; a record of another table raises `KBError`."""
        rec = self.get(id_)
        if not isinstance(rec, table):
            raise KBError(f"{id_!r} is a {type(rec).__name__}, not a {table.__name__}")
        return rec

    def list(self, table: type[R], **filters: object) -> list[R]:
        """All rows of `table` whose columns equal `filters`, ordered by id."""
        cols = table.model_fields
        unknown = set(filters) - set(cols)
        if unknown:
            raise ValueError(f"{table.__name__} has no columns {sorted(unknown)}")
        stmt = select(table)
        for name, value in filters.items():
            stmt = stmt.where(getattr(table, name) == value)
        with self.read_session() as s:
            return list(s.exec(stmt.order_by(table.id)))  # type: ignore[attr-defined]

    def usable(self, table: type[R], **filters: object) -> builtins.list[R]:
        """Like `list`, without the rows generation must not read (see `skip_unusable`)."""
        return self.skip_unusable(self.list(table, **filters))

    def skip_unusable(self, rows: Iterable[R]) -> builtins.list[R]:
        """`rows` without those that are quarantined or break a rule (`kb.store.rules`); each of the latter is
        warned about once per process, naming it, why, and `kb doctor --fix`, which quarantines it."""
        kept: list[R] = []
        broken: list[tuple[SQLModel, list[str]]] = []
        for r in rows:
            if getattr(r, "quarantine", ""):
                continue
            problems = violations(r, stored=True)
            if problems:
                broken.append((r, problems))
            else:
                kept.append(r)
        fresh = [(r, p) for r, p in broken if r.id not in _WARNED]  # type: ignore[attr-defined]
        if fresh:
            _WARNED.update(r.id for r, _ in fresh)  # type: ignore[attr-defined]
            named = "; ".join(f"{r.__tablename__} {r.id}: {', '.join(p)}" for r, p in fresh[:3])  # type: ignore[attr-defined]
            more = f" (+{len(fresh) - 3} more)" if len(fresh) > 3 else ""
            log.warning("skipped %d stored record(s) that break the KB's rules: %s%s; `kb doctor` lists them and "
                        "`kb doctor --fix` quarantines them", len(fresh), named, more)
        return kept

    def list_kernels(self, **filters: object) -> builtins.list[Kernel]:
        """Kernels filtered by column equality, e.g. `list_kernels(arch="sm90", head_dim=128)`."""
        return self.list(Kernel, **filters)

    def lineage(self, kernel_id: str) -> builtins.list[Kernel]:
        """The kernel followed by its parent, grandparent, ... (stops on a cycle)."""
        chain: list[Kernel] = []
        seen: set[str] = set()
        cur: str | None = kernel_id
        with self.read_session() as s:
            while cur and cur not in seen:
                seen.add(cur)
                k = s.get(Kernel, cur)
                if k is None:
                    break
                chain.append(k)
                cur = k.parent_id
        return chain

    def counts(self) -> Counts:
        with self.read_session() as s:
            rows = {name: s.exec(select(func.count()).select_from(m)).one() for name, m in TABLE_BY_NAME.items()}
        return Counts(rows, {c: self.vectors.count(c) for c in COLLECTIONS})

    def vector_query(
        self, collection: str, text: str, k: int = 10, where: Mapping[str, object] | None = None
    ) -> builtins.list[tuple[str, float]]:
        """The `k` rows of `collection` nearest to `text` as (id, cosine distance), nearest first.

        Ids Chroma returns without a SQL row (drift) are dropped with a warning.
        """
        if collection not in COLLECTIONS:
            raise KBError(f"unknown collection {collection!r}; one of {list(COLLECTIONS)}")
        hits = self.vectors.query(collection, self.embedder.embed([text])[0], k, where)
        return [(row.id, dist) for row, dist in self.hit_rows(collection, hits)]  # type: ignore[attr-defined]

    def hit_rows(self, collection: str, hits: Sequence[tuple[str, float]]) -> builtins.list[tuple[SQLModel, float]]:
        """The SQL rows of vector `hits` (id, distance) in one SELECT, in hit order.

        Ids Chroma returns without a SQL row (drift) are dropped with a warning, and rows generation must not
        read (`skip_unusable`) are dropped.
        """
        if not hits:
            return []
        model = EMBEDDED[collection]
        with self.read_session() as s:
            rows = {r.id: r for r in s.exec(select(model).where(model.id.in_([h[0] for h in hits])))}  # type: ignore[attr-defined]
        if len(rows) < len(hits):  # hits have distinct ids
            log.warning("%d %s embeddings have no row; run `kb doctor --fix`", len(hits) - len(rows), collection)
        ok = {r.id for r in self.skip_unusable(rows.values())}  # type: ignore[attr-defined]
        return [(rows[i], dist) for i, dist in hits if i in ok]

    # -- maintenance -----------------------------------------------------------
    def doctor(self, fix: bool = False) -> DoctorReport:
        return run_doctor(self, fix=fix)

    def export_jsonl(self, path: Path | str) -> Mapping[str, int]:
        return portable.export_jsonl(self, Path(path))

    def import_jsonl(self, path: Path | str) -> Mapping[str, int]:
        return portable.import_jsonl(self, Path(path))


@contextmanager
def _home_lock(home: Path) -> Iterator[None]:
    """Serialise first-time creation (SQLite schema, Chroma dir) between processes."""
    try:
        home.mkdir(parents=True, exist_ok=True)
        if not os.access(home, os.W_OK):
            raise PermissionError(13, "not writable", str(home))
        fd = os.open(home / ".kb.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise KBError(f"cannot use KB_HOME {home}: {err.strerror or err}", hint="set KB_HOME to a writable directory") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def open_kb(settings: Settings, *, create: bool = True, embedder: Embedder | None = None) -> KnowledgeBase:
    """Open (and with `create`, initialise) the KB that `settings` point at.

    Raises `KBError` for an unwritable home, a corrupt or foreign database, a schema
    version this code cannot use, an unreachable Chroma server, or (without `create`)
    a KB that does not exist yet. `embedder` defaults to the settings' model, loaded lazily.
    """
    target = db.parse_db_url(settings.resolved_db_url)
    if not create and target.path is not None and not target.path.exists():
        raise KBError(f"no knowledge base at {target.path}", hint="run `kb init`, or set KB_HOME to an existing KB")
    if target.path is not None and target.path.exists() and not target.path.is_file():
        raise KBError(f"{target.path} is not a database file", hint="set KB_HOME or KB_DB_URL elsewhere")
    with _home_lock(settings.home):
        if target.path is not None:
            try:
                target.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise KBError(f"cannot create {target.path.parent}: {err.strerror}") from err
        engines = db.make_engines(target.url)
        try:
            if create:
                db.ensure_schema(engines)
            elif not db.check_schema(engines):
                raise KBError(f"{target.display} has no kernel-kb tables", hint="run `kb init`")
            vectors = open_vectors(settings.chroma_url, settings.chroma_dir, _model_name(settings, embedder))
        except BaseException:
            engines.dispose()
            raise
    return KnowledgeBase(settings, engines, vectors, embedder)


def _model_name(settings: Settings, embedder: Embedder | None) -> str:
    return embedder.name if embedder is not None else settings.embed_model



