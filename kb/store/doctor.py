"""`kb doctor`: find (and with `fix`, repair) drift between the SQL rows and Chroma.

Drift kinds: a row without its embedding, an embedding without its row (orphan),
an embedding whose document no longer matches its row (stale), and a kernel whose
stored `content_hash` is not the sha256 of its stored IR text.
Repair: recompute the hash (and mark the kernel unverified, since its text changed
under us), embed missing and stale rows, delete orphans. SQL is never deleted from.
Invariant: after `run_doctor(kb, fix=True)`, `run_doctor(kb)` reports no issues
unless a writer ran in between.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from sqlmodel import Session, select

from kb.store import db
from kb.store.ids import sha256_text
from kb.store.models import Kernel
from kb.store.records import EMBEDDED, embedding_doc

if TYPE_CHECKING:
    from kb.store.kb import KnowledgeBase

__all__ = ["DriftKind", "Drift", "DoctorReport", "run_doctor"]

log = logging.getLogger(__name__)

HASH_NOTE = "doctor: stored IR text did not match content_hash; hash recomputed, re-verify"


class DriftKind(StrEnum):
    MISSING_EMBEDDING = "missing_embedding"
    ORPHAN_EMBEDDING = "orphan_embedding"
    STALE_EMBEDDING = "stale_embedding"
    HASH_MISMATCH = "hash_mismatch"


@dataclass(frozen=True)
class Drift:
    kind: DriftKind
    table: str
    id: str
    detail: str = ""


@dataclass(frozen=True)
class DoctorReport:
    issues: tuple[Drift, ...]
    fixed: bool  # True when `issues` were repaired

    @property
    def ok(self) -> bool:
        return not self.issues

    def by_kind(self) -> dict[DriftKind, int]:
        return dict(Counter(d.kind for d in self.issues))

    def summary(self) -> str:
        if self.ok:
            return "no drift: every row has its embedding and every hash matches"
        parts = ", ".join(f"{n} {k.value.replace('_', ' ')}" for k, n in sorted(self.by_kind().items()))
        return f"{'fixed' if self.fixed else 'found'}: {parts}"


def _hash_issues(kb: KnowledgeBase) -> list[Drift]:
    with kb.read_session() as s:
        rows = s.exec(select(Kernel.id, Kernel.content_hash, Kernel.ir_text)).all()
    return [
        Drift(DriftKind.HASH_MISMATCH, "kernels", id_, f"stored {h[:12]}…, text hashes to {sha256_text(t)[:12]}…")
        for id_, h, t in rows
        if sha256_text(t) != h
    ]


def _vector_issues(kb: KnowledgeBase) -> list[Drift]:
    out: list[Drift] = []
    for col, table in EMBEDDED.items():
        with kb.read_session() as s:
            want = {r.id: embedding_doc(r).metadata["doc_hash"] for r in s.exec(select(table))}  # type: ignore[attr-defined]
        have = kb.vectors.doc_hashes(col)
        out += [Drift(DriftKind.MISSING_EMBEDDING, col, i) for i in sorted(want.keys() - have.keys())]
        out += [Drift(DriftKind.ORPHAN_EMBEDDING, col, i) for i in sorted(have.keys() - want.keys())]
        out += [
            Drift(DriftKind.STALE_EMBEDDING, col, i, "document changed since it was embedded")
            for i in sorted(want.keys() & have.keys())
            if want[i] != have[i]
        ]
    return out


def _fix_hashes(kb: KnowledgeBase, ids: list[str]) -> None:
    def txn() -> None:
        with Session(kb.engines.write) as s:
            for id_ in ids:
                k = s.get(Kernel, id_)
                if k is not None:
                    k.content_hash = sha256_text(k.ir_text)
                    k.verified = False
                    k.verify_note = HASH_NOTE
            s.commit()

    db.retrying(txn)


def run_doctor(kb: KnowledgeBase, fix: bool = False) -> DoctorReport:
    """Report drift; with `fix`, repair it and report what was repaired."""
    issues = _hash_issues(kb)
    if fix and issues:
        _fix_hashes(kb, [d.id for d in issues])
    vec = _vector_issues(kb)
    if fix and vec:
        for col, table in EMBEDDED.items():
            orphans = [d.id for d in vec if d.table == col and d.kind is DriftKind.ORPHAN_EMBEDDING]
            kb.vectors.delete(col, orphans)
            redo = {d.id for d in vec if d.table == col and d.kind is not DriftKind.ORPHAN_EMBEDDING}
            if redo:
                with kb.read_session() as s:
                    rows = list(s.exec(select(table).where(table.id.in_(redo))))  # type: ignore[attr-defined]
                kb._embed(rows, force=True)
        log.info("doctor repaired %d issues", len(issues) + len(vec))
    return DoctorReport(tuple(issues + vec), fixed=fix and bool(issues or vec))
