"""The one write path of the store: upsert rows in one transaction, then embed what Chroma lacks.

`KnowledgeBase` writes, `kb import` and `kb doctor --fix` all go through these functions, so every
path keeps the same upsert rule (first write's timestamps stay; kernels are append-only history) and
the same order (SQL commit first, embeddings after; see kb/store/kb.py for why).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlmodel import Session, SQLModel

from kb.store import db
from kb.store.handle import StoreHandle
from kb.store.models import Kernel
from kb.store.records import COLLECTION_OF, embedding_doc
from kb.store.vectors import COLLECTIONS

__all__ = ["commit_rows", "embed_rows", "upsert"]

# Columns an upsert never overwrites: the first write's timestamp stays.
_KEEP_ON_UPDATE = frozenset({"id", "created_at", "fetched_at", "started_at"})


def upsert(s: Session, record: SQLModel) -> None:
    """Insert `record`, or update the row with its id (a kernel only gains `verified`)."""
    existing = s.get(type(record), record.id)  # type: ignore[attr-defined]
    if existing is None:
        s.add(record)
        return
    if isinstance(existing, Kernel):
        _update_kernel(existing, record)  # type: ignore[arg-type]
        return
    for name in type(record).model_fields:
        if name not in _KEEP_ON_UPDATE:
            setattr(existing, name, getattr(record, name))


def _update_kernel(existing: Kernel, record: Kernel) -> None:
    """Kernels are append-only history: the first write of an IR program fixes its provenance and lineage
    (parent, source, file, spec, code). Writing the same program again (a re-generation, a re-ingest, an
    import) changes nothing, except that a kernel stored unverified may be upgraded by a verified write."""
    if record.verified and not existing.verified:
        existing.verified, existing.verify_note = True, record.verify_note


def commit_rows(engines: db.Engines, records: Sequence[SQLModel]) -> None:
    """Upsert `records` in order (parents before children) in ONE transaction, retried while the database
    is busy; a foreign-key or constraint failure raises sqlalchemy's IntegrityError with nothing written."""

    def txn() -> None:
        with Session(engines.write, expire_on_commit=False) as s:
            for r in records:
                upsert(s, r)
                s.flush()  # rows in order, so parents precede children under foreign keys
            s.commit()

    db.retrying(txn)


def embed_rows(kb: StoreHandle, records: Sequence[SQLModel], force: bool = False) -> int:
    """Embed and upsert those of `records` that have a collection (kernels, snippets, lessons) and whose
    document Chroma does not already hold (all of them with `force`); returns how many. One model call per
    chunk across all collections (the model call dominates the cost). Quarantined rows are never embedded."""
    docs = [embedding_doc(r) for r in records if type(r) in COLLECTION_OF and not getattr(r, "quarantine", "")]
    if not force:
        todo = []
        for col in COLLECTIONS:
            mine = [d for d in docs if d.collection == col]
            have = kb.vectors.doc_hashes(col, [d.id for d in mine]) if mine else {}
            todo += [d for d in mine if have.get(d.id) != d.metadata["doc_hash"]]
        docs = todo
    step = max(1, kb.settings.embed_batch * 4)
    for i in range(0, len(docs), step):
        chunk = docs[i : i + step]
        vecs = kb.embedder.embed([d.document for d in chunk])
        for col in COLLECTIONS:
            idx = [j for j, d in enumerate(chunk) if d.collection == col]
            if idx:
                kb.vectors.upsert(
                    col, [chunk[j].id for j in idx], [vecs[j] for j in idx],
                    [chunk[j].document for j in idx], [chunk[j].metadata for j in idx],
                )
    return len(docs)
