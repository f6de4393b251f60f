"""Record ids: content hashes, so that writing the same thing twice yields one row.

Invariant: an id is a pure function of the fields that identify a record
(`k-` + 16 hex of sha256(ir_text) for kernels), never of when it was written;
runs are the exception (events, not content) and get a random id.
"""

from __future__ import annotations

import hashlib
import uuid

__all__ = ["sha256_text", "hashed_id", "kernel_id", "run_id", "PREFIXES"]

# Id prefix -> table name; `KnowledgeBase.get` dispatches on it.
PREFIXES: dict[str, str] = {
    "src-": "sources",
    "k-": "kernels",
    "s-": "snippets",
    "t-": "tunables",
    "p-": "perf_records",
    "r-": "generation_runs",
    "a-": "attempts",
    "l-": "lessons",
}


def sha256_text(text: str) -> str:
    """Hex sha256 of the UTF-8 bytes of `text` (exactly as stored, no normalisation)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def hashed_id(prefix: str, *parts: object) -> str:
    """`prefix` + 16 hex of sha256 over `parts` joined by NUL (None becomes empty)."""
    joined = "\0".join("" if p is None else str(p) for p in parts)
    return prefix + sha256_text(joined)[:16]


def kernel_id(content_hash: str) -> str:
    return "k-" + content_hash[:16]


def run_id() -> str:
    return "r-" + uuid.uuid4().hex[:16]
