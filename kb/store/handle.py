"""What the store's operations need of an open KB: `StoreHandle`, which a `KnowledgeBase` is.

The write path (kb.store.writes), `kb doctor` (kb.store.doctor) and `kb export` / `kb import` (kb.store.portable)
take the KB they work on as this protocol rather than as `kb.store.kb.KnowledgeBase`: that class calls them
(`write_kernel`, `doctor`, `export_jsonl`), so they stay below it and import nothing of it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from sqlmodel import Session

from kb.embed import Embedder
from kb.settings import Settings
from kb.store.db import Engines
from kb.store.vectors import VectorStore

__all__ = ["StoreHandle"]


class StoreHandle(Protocol):
    """An open KB: its settings, SQL engines (`engines.write` for transactions), vector store, and embedder
    (loaded on first use: a write that embeds nothing never loads the model)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def engines(self) -> Engines: ...

    @property
    def vectors(self) -> VectorStore: ...

    @property
    def embedder(self) -> Embedder: ...

    def read_session(self) -> AbstractContextManager[Session]: ...
