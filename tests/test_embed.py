"""The embedding wrapper: offline default model, lazy load, batching, normalised vectors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kb.embed import DEFAULT_MODEL, SentenceEmbedder, get_embedder, resolve_model
from kb.errors import KBError
from kb.settings import Settings


def test_default_name_maps_to_packaged_model() -> None:
    path = Path(resolve_model(DEFAULT_MODEL))
    assert path.is_dir() and (path / "config.json").exists()
    assert resolve_model("/some/local/model") == "/some/local/model"


def test_model_loads_lazily_once() -> None:
    e = SentenceEmbedder()
    assert e._model is None  # constructing costs nothing
    assert get_embedder(Settings()) is get_embedder(Settings())


def test_vectors_are_normalised_and_batch_independent(embedder) -> None:  # noqa: ANN001
    texts = [f"causal mask with head dim {d}" for d in (32, 64, 128)] + ["logit softcap tanh"]
    small = SentenceEmbedder(batch_size=2)
    small._model = embedder._load()  # same weights, different batch size
    a, b = embedder.embed(texts), small.embed(texts)
    assert len(a) == 4 and all(len(v) == 384 for v in a)
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-5 for v in a)
    assert all(abs(x - y) < 1e-4 for u, v in zip(a, b) for x, y in zip(u, v))
    assert embedder.embed([]) == []


def test_similar_texts_are_closer(embedder) -> None:  # noqa: ANN001
    q, near, far = embedder.embed(["sliding window attention mask", "local window mask for attention", "download a wheel from pypi"])
    dot = lambda u, v: sum(x * y for x, y in zip(u, v))  # noqa: E731
    assert dot(q, near) > dot(q, far)


def test_missing_model_is_a_kb_error(tmp_path: Path) -> None:
    with pytest.raises(KBError, match="cannot load embedding model"):
        SentenceEmbedder(str(tmp_path / "no-such-model")).embed(["x"])
