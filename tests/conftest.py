"""Shared fixtures: one real embedding model per test session, a fresh KB per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kb.embed import SentenceEmbedder, get_embedder
from kb.settings import Settings, load_settings

@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test sees the developer's KB: every KB_* variable is cleared, KB_HOME points into tmp_path."""
    for name in list(os.environ):
        if name.startswith("KB_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KB_HOME", str(tmp_path / "kb-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def embedder() -> SentenceEmbedder:
    """The real default model, loaded once; the same instance the CLI uses in-process."""
    return get_embedder(Settings())


@pytest.fixture
def kb_settings(tmp_path: Path) -> Settings:
    return load_settings(home=tmp_path / "kb")


@pytest.fixture
def kb(kb_settings: Settings, embedder: SentenceEmbedder) -> Iterator:
    from kb.store import open_kb

    with open_kb(kb_settings, embedder=embedder) as store:
        yield store

