"""Identity, redaction and embedding text of records.

`assign_id` fills a record's id (and a kernel's content_hash) from its identifying
fields, after `redact_record` has removed credentials from the free-text columns that
may quote a URL (`FREE_TEXT`: a run's error, an attempt's feedback, a command line), so
no credential is stored, exported or hashed into an id; `embedding_doc` gives the text
and Chroma metadata for the three embedded tables. `doc_hash` (over document and metadata) lets writes skip unchanged rows and
`kb doctor` see an embedding that is stale with respect to its row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TypeVar

from sqlmodel import SQLModel

from kb.features import Features
from kb.redact import redact_text
from kb.store import ids
from kb.store.models import Attempt, GenerationRun, Kernel, Lesson, PerfRecord, Snippet, Source, Tunable

__all__ = ["assign_id", "redact_record", "FREE_TEXT", "EmbeddingDoc", "embedding_doc", "COLLECTION_OF", "EMBEDDED"]

R = TypeVar("R", bound=SQLModel)

# Embedded table -> Chroma collection name.
COLLECTION_OF: dict[type[SQLModel], str] = {Kernel: "kernels", Snippet: "snippets", Lesson: "lessons"}
EMBEDDED: dict[str, type[SQLModel]] = {v: k for k, v in COLLECTION_OF.items()}
# Free-text columns that may quote a URL (an LLM or database error, a command line): redacted on every write,
# import and export. Code and IR columns are never rewritten (their hashes are identities).
FREE_TEXT: dict[type[SQLModel], tuple[str, ...]] = {
    GenerationRun: ("spec_path", "error"), Attempt: ("feedback",), Lesson: ("text",), Kernel: ("verify_note",),
    PerfRecord: ("command", "notes", "citation"),
}


def redact_record(record: R) -> R:
    """Credentials in `record`'s free-text columns replaced by `***` (`kb.redact`), in place; returns `record`."""
    for name in FREE_TEXT.get(type(record), ()):
        value = getattr(record, name)
        if isinstance(value, str) and ("://" in value or "=" in value) and (clean := redact_text(value)) != value:
            setattr(record, name, clean)
    return record


def assign_id(record: R) -> R:
    """Redact `record` (`redact_record`), then fill `record.id` (and `Kernel.content_hash`) in place when empty;
    returns `record`."""
    redact_record(record)
    if isinstance(record, Kernel) and not record.content_hash:
        record.content_hash = ids.sha256_text(record.ir_text)
    if record.id:  # type: ignore[attr-defined]
        return record
    record.id = _derive_id(record)
    return record


def _derive_id(r: SQLModel) -> str:
    match r:
        case Kernel():
            return ids.kernel_id(r.content_hash)
        case Source():
            return ids.hashed_id("src-", r.distribution, r.version, r.kind, r.filename, r.sha256)
        case Snippet():
            # kind + text + provenance; a snippet with no source excerpt is identified by its IR.
            body = r.text or r.ir_text
            return ids.hashed_id("s-", r.kind, body, r.source_id, r.kernel_id, r.file, r.line_start, r.line_end)
        case Tunable():
            return ids.hashed_id(
                "t-", r.source_id, r.family, r.arch, r.head_dim, r.dtype, _canon(r.params_json), r.condition,
                r.file, r.line_start, r.line_end,
            )
        case PerfRecord():
            when = r.measured_at.isoformat() if r.measured_at else ""
            # a measured design is part of the identity; records without one keep their schema-1 ids
            design = (_canon(r.design_json), r.arch) if r.design_json not in ("", "{}") else ()
            return ids.hashed_id(
                "p-", r.kernel_id, r.kind, r.gpu, r.driver, r.torch_version, r.triton_version,
                _canon(r.shape_json), r.dtype, r.ms, r.tflops, r.command, when, r.citation, *design,
            )
        case GenerationRun():
            return ids.run_id()
        case Attempt():
            return ids.hashed_id("a-", r.run_id, r.n)
        case Lesson():
            return ids.hashed_id("l-", r.kind, r.text)
    raise TypeError(f"not a kernel-kb record: {type(r).__name__}")


def _canon(text: str) -> str:
    """Canonical JSON so that key order does not change an id."""
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return text


@dataclass(frozen=True)
class EmbeddingDoc:
    collection: str
    id: str
    document: str
    metadata: dict[str, str | int | float | bool]


def _features(text: str) -> Features:
    try:
        return Features.from_json(text)
    except (TypeError, ValueError):
        return Features()


def _json_dict(text: str) -> dict[str, object]:
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _clean(meta: dict[str, object]) -> dict[str, str | int | float | bool]:
    """Chroma metadata cannot hold None."""
    return {k: v for k, v in meta.items() if v is not None}  # type: ignore[misc]


def embedding_doc(r: SQLModel) -> EmbeddingDoc:
    """The document and filterable metadata stored in Chroma for an embedded record."""
    match r:
        case Kernel():
            feats = _features(r.features_json)
            doc = f"{r.family} {r.name}\n{feats.describe()}\n{r.ir_text}"
            meta: dict[str, object] = {
                "arch": r.arch, "dtype": r.dtype, "head_dim": r.head_dim, "family": r.family,
                "origin": r.origin, "verified": r.verified,
            }
        case Snippet():
            doc = f"{r.kind}: {r.title}\n{r.ir_text}\n{r.text}"
            given = _json_dict(r.features_json)  # only what the lifter stated, no defaults
            meta = {"kind": r.kind, "kernel_id": r.kernel_id, "source_id": r.source_id}
            meta.update({k: given[k] for k in ("arch", "dtype", "head_dim") if k in given})
        case Lesson():
            doc = f"{r.kind}: {r.text}"
            meta = {"kind": r.kind, "run_id": r.run_id}
        case _:
            raise TypeError(f"{type(r).__name__} is not embedded")
    clean = _clean(meta)
    # Covers the metadata too: a changed filter field (e.g. verified) must reach Chroma.
    clean["doc_hash"] = ids.sha256_text(doc + "\0" + json.dumps(clean, sort_keys=True))[:16]
    return EmbeddingDoc(COLLECTION_OF[type(r)], r.id, doc, clean)
