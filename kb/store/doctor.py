"""`kb doctor`: find (and with `fix`, repair) what a crash, a kill or an older kernel-kb left behind.

Drift kinds: a row without its embedding, an embedding without its row (orphan),
an embedding whose document no longer matches its row (stale), a kernel whose identity
is broken (its stored IR text does not hash to its `content_hash`, or its id is not
`k-` + that hash: hash_mismatch), a kernel, snippet, tunable, perf record or lesson that
breaks another rule of `kb.store.rules` (invalid_record: written by an older kernel-kb
or by hand), a kernel whose `parent_id` names no kernel, a cycle of `parent_id` links,
a generation run left `running` by a process that is gone (SIGKILL, power loss), and,
when `temp_root` is given (the CLI passes the temp directory), a `kb-verify-PID-START-…`
directory whose owner is gone.
Repair: quarantine the broken kernels and invalid records (their `quarantine` column says
why; the row, its id and its links stay, nothing reads it for generation or retrieval, and
its embedding is removed), cut the broken or cyclic `parent_id` link (NULL; for a cycle, the
link of its newest kernel), mark the dead run `interrupted`, embed missing and stale rows,
delete orphans and orphaned temp directories. No SQL row is ever deleted.
Invariant: after `run_doctor(kb, fix=True)`, `run_doctor(kb)` reports no issues
unless a writer ran in between.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from sqlalchemy import func
from sqlmodel import Session, select

from kb.procs import VERIFY_TEMP, Owner, owner_of_temp
from kb.store import db, writes
from kb.store.handle import StoreHandle
from kb.store.models import QUARANTINABLE, GenerationRun, Kernel, RunStatus
from kb.store.records import COLLECTION_OF, EMBEDDED, embedding_doc
from kb.store.rules import violations

__all__ = ["DriftKind", "Drift", "DoctorReport", "run_doctor", "remove_orphan_temp_dirs", "IDENTITY_RULES"]

log = logging.getLogger(__name__)

# the kernel rules whose breach is a hash_mismatch (the row is not the program its id names)
IDENTITY_RULES = ("content_hash is sha256(ir_text)", "id is k- + the first 16 hex digits of content_hash")
LINEAGE_RULE = "a kernel is not its own parent"  # a lineage_cycle: --fix cuts the link, the kernel stays in use


class DriftKind(StrEnum):
    MISSING_EMBEDDING = "missing_embedding"
    INVALID_RECORD = "invalid_record"
    ORPHAN_EMBEDDING = "orphan_embedding"
    STALE_EMBEDDING = "stale_embedding"
    HASH_MISMATCH = "hash_mismatch"
    MISSING_PARENT = "missing_parent"
    LINEAGE_CYCLE = "lineage_cycle"
    STUCK_RUN = "stuck_run"
    ORPHAN_TEMP_DIR = "orphan_temp_dir"


@dataclass(frozen=True)
class Drift:
    kind: DriftKind
    table: str  # a table or Chroma collection; "tmp" for a temp directory (id: its path)
    id: str
    detail: str = ""


@dataclass(frozen=True)
class DoctorReport:
    issues: tuple[Drift, ...]
    fixed: bool  # True when `issues` were repaired
    quarantined: Mapping[str, int] = field(default_factory=dict)  # table -> rows set aside (now, after any fix)

    @property
    def ok(self) -> bool:
        return not self.issues

    def by_kind(self) -> dict[DriftKind, int]:
        return dict(Counter(d.kind for d in self.issues))

    def summary(self) -> str:
        aside = sum(self.quarantined.values())
        held = (f"; {aside} quarantined row(s) kept aside ({', '.join(f'{t} {n}' for t, n in self.quarantined.items())}; "
                "`kb show ID` says why)") if aside else ""
        if self.ok:
            return ("no issues: every row has its embedding and keeps the rules, every hash matches, lineage has no broken "
                    "link or cycle, no run is left running by a dead process" + held)
        parts = ", ".join(f"{n} {k.value.replace('_', ' ')}" for k, n in sorted(self.by_kind().items()))
        return f"{'fixed' if self.fixed else 'found'}: {parts}{held}"


# -- records that break a rule: identity (hash_mismatch) or any other rule (invalid_record)

def _record_issues(kb: StoreHandle) -> list[Drift]:
    out = []
    for table in QUARANTINABLE:
        with kb.read_session() as s:
            rows = list(s.exec(select(table).where(table.quarantine == "")))  # type: ignore[attr-defined]
        for r in rows:
            broken = [b for b in violations(r, stored=True) if b != LINEAGE_RULE]
            if broken:
                identity = any(b.startswith(IDENTITY_RULES) for b in broken)
                kind = DriftKind.HASH_MISMATCH if identity else DriftKind.INVALID_RECORD
                out.append(Drift(kind, str(table.__tablename__), r.id, "; ".join(broken) + "; --fix quarantines it"))  # type: ignore[attr-defined]
    return out


def _quarantine(kb: StoreHandle, issues: list[Drift]) -> None:
    """Set each row aside with its reason, then drop the embeddings of those that had one."""
    tables = {str(t.__tablename__): t for t in QUARANTINABLE}

    def txn() -> None:
        with Session(kb.engines.write) as s:
            for d in issues:
                row = s.get(tables[d.table], d.id)
                if row is not None and not getattr(row, "quarantine"):
                    setattr(row, "quarantine", f"{d.kind.value}: {d.detail.removesuffix('; --fix quarantines it')}")
                    s.add(row)
            s.commit()

    db.retrying(txn)
    for table, col in COLLECTION_OF.items():
        kb.vectors.delete(col, [d.id for d in issues if d.table == table.__tablename__])


def _quarantined(kb: StoreHandle) -> dict[str, int]:
    out: dict[str, int] = {}
    with kb.read_session() as s:
        for table in QUARANTINABLE:
            n = s.exec(select(func.count()).select_from(table).where(table.quarantine != "")).one()  # type: ignore[attr-defined]
            if n:
                out[str(table.__tablename__)] = n
    return out


def _vector_issues(kb: StoreHandle) -> list[Drift]:
    out: list[Drift] = []
    for col, table in EMBEDDED.items():
        with kb.read_session() as s:  # a quarantined row has no embedding
            rows = s.exec(select(table).where(table.quarantine == ""))  # type: ignore[attr-defined]
            want = {r.id: embedding_doc(r).metadata["doc_hash"] for r in rows}  # type: ignore[attr-defined]
        have = kb.vectors.doc_hashes(col)
        out += [Drift(DriftKind.MISSING_EMBEDDING, col, i) for i in sorted(want.keys() - have.keys())]
        out += [Drift(DriftKind.ORPHAN_EMBEDDING, col, i) for i in sorted(have.keys() - want.keys())]
        out += [
            Drift(DriftKind.STALE_EMBEDDING, col, i, "document changed since it was embedded")
            for i in sorted(want.keys() & have.keys())
            if want[i] != have[i]
        ]
    return out


# -- lineage: every parent_id names a kernel, and following parents always ends

def _lineage_issues(kb: StoreHandle) -> list[Drift]:
    with kb.read_session() as s:
        rows = s.exec(select(Kernel.id, Kernel.parent_id, Kernel.created_at)).all()
    parent = {id_: p for id_, p, _ in rows}
    created = {id_: c for id_, _, c in rows}
    out = [Drift(DriftKind.MISSING_PARENT, "kernels", id_, f"parent {p} is not in the KB; --fix cuts the link")
           for id_, p in sorted(parent.items()) if p is not None and p not in parent]
    done: set[str] = set()
    for start in sorted(parent):
        path: dict[str, int] = {}  # kernel -> position on this walk
        cur: str | None = start
        while cur in parent and cur not in done and cur not in path:
            path[cur] = len(path)
            cur = parent[cur]
        if cur in path:  # a cycle: cut the link of its newest kernel (the link that closed it)
            cycle = list(path)[path[cur]:]
            cut = max(cycle, key=lambda k: (str(created[k] or ""), k))
            out.append(Drift(DriftKind.LINEAGE_CYCLE, "kernels", cut,
                             "cycle " + " -> ".join(cycle + [cur]) + f"; --fix cuts the parent link of {cut} (the newest)"))
        done.update(path)
    return out


def _fix_lineage(kb: StoreHandle, ids: list[str]) -> None:
    def txn() -> None:
        with Session(kb.engines.write) as s:
            for id_ in ids:
                k = s.get(Kernel, id_)
                if k is not None:
                    k.parent_id = None
            s.commit()

    db.retrying(txn)


# -- runs: a run at `running` whose owning process is gone was killed (SIGKILL, power loss)

def _run_issues(kb: StoreHandle) -> list[Drift]:
    with kb.read_session() as s:
        rows = s.exec(select(GenerationRun).where(GenerationRun.status == RunStatus.RUNNING.value)).all()
    out = []
    for r in rows:
        owner = Owner.parse(r.error)
        if owner is None:
            out.append(Drift(DriftKind.STUCK_RUN, "generation_runs", r.id, "running, but no owning process was recorded"))
        elif owner.alive() is False:  # None: another host, whose processes we cannot see
            out.append(Drift(DriftKind.STUCK_RUN, "generation_runs", r.id,
                             f"running, but its process (pid {owner.pid} on {owner.host}) is gone"))
    return out


def _fix_runs(kb: StoreHandle, issues: list[Drift]) -> None:
    def txn() -> None:
        with Session(kb.engines.write) as s:
            for d in issues:
                r = s.get(GenerationRun, d.id)
                if r is not None and r.status == RunStatus.RUNNING.value:
                    r.status = RunStatus.INTERRUPTED.value
                    r.error = f"interrupted: {d.detail.removeprefix('running, but ')} (found by kb doctor)"
                    s.add(r)
            s.commit()

    db.retrying(txn)


# -- temp directories of verify runs whose owner is gone (host-local, so only when asked)

def _temp_issues(temp_root: Path) -> list[Drift]:
    out = []
    for path in sorted(temp_root.glob(VERIFY_TEMP + "*")):
        owner = owner_of_temp(path.name)  # None: an older kernel-kb's name, without its owner; left alone
        try:
            mine = path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if owner is not None and mine and owner.alive() is False:
            out.append(Drift(DriftKind.ORPHAN_TEMP_DIR, "tmp", str(path), f"its owner (pid {owner.pid}) is gone"))
    return out


def remove_orphan_temp_dirs(temp_root: Path) -> int:
    """Remove this user's verify temp directories under `temp_root` whose owner process is gone; how many."""
    gone = _temp_issues(temp_root)
    for d in gone:
        shutil.rmtree(d.id, ignore_errors=True)
    return len(gone)


def run_doctor(kb: StoreHandle, fix: bool = False, temp_root: Path | None = None) -> DoctorReport:
    """Report issues; with `fix`, repair them and report what was repaired.

    `temp_root` (e.g. `tempfile.gettempdir()`) adds orphaned verify temp directories under it;
    they are this machine's state, not the KB's, so library callers leave it out.
    """
    issues = _record_issues(kb)
    if fix and issues:
        _quarantine(kb, issues)
    lineage = _lineage_issues(kb)
    if fix and lineage:
        _fix_lineage(kb, [d.id for d in lineage])
    runs = _run_issues(kb)
    if fix and runs:
        _fix_runs(kb, runs)
    temps = _temp_issues(temp_root) if temp_root is not None else []
    if fix and temp_root is not None:
        remove_orphan_temp_dirs(temp_root)
    vec = _vector_issues(kb)
    if fix and vec:
        for col, table in EMBEDDED.items():
            orphans = [d.id for d in vec if d.table == col and d.kind is DriftKind.ORPHAN_EMBEDDING]
            kb.vectors.delete(col, orphans)
            redo = {d.id for d in vec if d.table == col and d.kind is not DriftKind.ORPHAN_EMBEDDING}
            if redo:
                with kb.read_session() as s:
                    rows = list(s.exec(select(table).where(table.id.in_(redo))))  # type: ignore[attr-defined]
                writes.embed_rows(kb, rows, force=True)
    found = issues + lineage + runs + temps + vec
    if fix and found:
        log.info("doctor repaired %d issues", len(found))
    return DoctorReport(tuple(found), fixed=fix and bool(found), quarantined=_quarantined(kb))
