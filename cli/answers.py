"""What `kb query`, `kb show` and `kb stats` answer, as JSON-ready dicts: one shape whether this process opened the
KB or a `kb serve` did (the service returns these dicts; the commands print them with `--json` or render them)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kb.errors import KBError

if TYPE_CHECKING:
    from kb.features import Features
    from kb.store import KnowledgeBase

__all__ = ["MODES", "query_answer", "show_answer", "stats_answer", "check_query_args"]

MODES = ("hybrid", "embedding", "structural")
MAX_K = 100


def check_query_args(k: int, mode: str) -> None:
    """The query options a user can get wrong, as one-line errors."""
    if mode not in MODES:
        raise KBError(f"unknown --mode {mode!r}; use hybrid, embedding or structural")
    if not 1 <= k <= MAX_K:
        raise KBError(f"-k must be between 1 and {MAX_K}, not {k}")


def query_answer(kb: KnowledgeBase, text: str, target: Features | None, *, k: int = 5, mode: str = "hybrid",
                 arch: str | None = None, dtype: str | None = None, head_dim: int | None = None,
                 memory: bool = True) -> dict[str, Any]:
    """The ranked kernels, snippets and lessons for a query text (and the traced spec's features, when there is one)."""
    from retrieve.hybrid import Filters, query

    check_query_args(k, mode)
    res = query(kb, text, target, k=k, mode=mode,  # type: ignore[arg-type]
                filters=Filters(arch=arch, dtype=dtype, head_dim=head_dim, memory=memory))
    return {"query": text, "mode": mode, "k": k, "target": json.loads(target.to_json()) if target else None,
            "kernels": [{"id": r.id, "name": r.name, "family": r.family, "origin": r.origin, "score": r.score,
                         "terms": r.terms} for r in res.kernels],
            "snippets": [asdict(s) for s in res.snippets], "lessons": res.lessons}


def show_answer(kb: KnowledgeBase, record_id: str) -> dict[str, Any]:
    """One record: its type, its fields, and for a kernel its provenance line and lineage ids."""
    from kb.store import Kernel, Source

    rec = kb.get(record_id)
    answer: dict[str, Any] = {"type": type(rec).__name__, "record": rec.model_dump(mode="json"),
                              "fields": list(type(rec).model_fields), "provenance": None, "lineage": []}
    if isinstance(rec, Kernel):
        src = kb.find(rec.source_id) if rec.source_id else None
        if isinstance(src, Source):
            span = f":{rec.line_start}-{rec.line_end}" if rec.line_start else ""
            answer["provenance"] = (f"{src.distribution}=={src.version} ({src.kind}) {rec.file}{span} "
                                    f"lifter {rec.lifter_version or '?'}")
        answer["lineage"] = [c.id for c in kb.lineage(rec.id)]
    return answer


def stats_answer(kb: KnowledgeBase) -> dict[str, Any]:
    """Rows per table and embeddings per Chroma collection."""
    counts = kb.counts()
    return {"rows": dict(counts.rows), "vectors": dict(counts.vectors)}
