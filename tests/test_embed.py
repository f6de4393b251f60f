"""The embedding wrapper: offline default model, lazy load, batching, normalised vectors."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kb.bert import BertEncoder, is_mean_pooled_bert
from kb.embed import DEFAULT_MODEL, SentenceEmbedder, get_embedder, resolve_model
from kb.errors import KBError
from kb.settings import Settings
from tests.support.repo import REPO, subprocess_env
from tests.support.store import make_kernel


def test_default_name_maps_to_packaged_model() -> None:
    path = Path(resolve_model(DEFAULT_MODEL))
    assert path.is_dir() and (path / "config.json").exists()
    assert resolve_model("/some/local/model") == "/some/local/model"


def test_model_loads_lazily_once() -> None:
    e = SentenceEmbedder()
    assert e._model is None  # constructing costs nothing
    assert get_embedder(Settings()) is get_embedder(Settings())


def test_vectors_are_normalised_and_batch_independent(embedder) -> None:
    texts = [f"causal mask with head dim {d}" for d in (32, 64, 128)] + ["logit softcap tanh"]
    small = SentenceEmbedder(batch_size=2)
    small._model = embedder._load()  # same weights, different batch size
    a, b = embedder.embed(texts), small.embed(texts)
    assert len(a) == 4 and all(len(v) == 384 for v in a)
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-5 for v in a)
    assert all(abs(x - y) < 1e-4 for u, v in zip(a, b) for x, y in zip(u, v))
    assert embedder.embed([]) == []


def test_similar_texts_are_closer(embedder) -> None:
    q, near, far = embedder.embed(["sliding window attention mask", "local window mask for attention", "download a wheel from pypi"])
    dot = lambda u, v: sum(x * y for x, y in zip(u, v))  # noqa: E731
    assert dot(q, near) > dot(q, far)


def test_missing_model_is_a_kb_error(tmp_path: Path) -> None:
    with pytest.raises(KBError, match="cannot load embedding model"):
        SentenceEmbedder(str(tmp_path / "no-such-model")).embed(["x"])


def _ir_texts() -> list[str]:
    """What the KB embeds: IR program texts (some longer than the model's 256 tokens), and short queries."""
    root = Path(__file__).resolve().parents[1]
    programs = sorted((root / "bench" / "kernels").glob("*.kbir"))
    assert programs, "bench/kernels holds IR programs"
    return [p.read_text() for p in programs] + ["", "causal mask, head dim 128 bf16", "ALiBi – λ·|i−j| bias ✓"]


@pytest.fixture(scope="module")
def reference_vectors() -> list[list[float]]:
    """sentence-transformers' vectors of `_ir_texts()`, the model loaded once."""
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415  seconds to import; every worker collects this module

    model = SentenceTransformer(resolve_model(DEFAULT_MODEL), device="cpu")
    return model.encode(_ir_texts(), batch_size=7, normalize_embeddings=True, show_progress_bar=False).tolist()


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_default_model_gives_sentence_transformers_vectors_without_it(embedder, reference_vectors, backend: str) -> None:
    texts = _ir_texts()
    model = embedder._load()
    assert isinstance(model, BertEncoder)
    ours = model.encode(texts, backend)
    reference = reference_vectors
    assert max(len(model.tokenizer.encode(t).ids) for t in texts) == 256  # truncation is exercised
    worst = max(abs(x - y) for u, v in zip(ours, reference, strict=True) for x, y in zip(u, v, strict=True))
    assert worst < 1e-6


def test_only_mean_pooled_bert_directories_skip_sentence_transformers(tmp_path: Path) -> None:
    source = Path(resolve_model(DEFAULT_MODEL))
    assert is_mean_pooled_bert(source)
    model = tmp_path / "cls"
    shutil.copytree(source, model, ignore=shutil.ignore_patterns("model.safetensors"))
    (model / "model.safetensors").symlink_to(source / "model.safetensors")
    assert is_mean_pooled_bert(model)
    pooling = model / "1_Pooling" / "config.json"
    pooling.write_text(pooling.read_text().replace('"pooling_mode_cls_token": false', '"pooling_mode_cls_token": true')
                       .replace('"pooling_mode_mean_tokens": true', '"pooling_mode_mean_tokens": false'))
    assert not is_mean_pooled_bert(model)  # CLS pooling: sentence-transformers runs it
    assert not is_mean_pooled_bert(tmp_path / "missing")


def test_a_free_text_query_imports_neither_torch_nor_sentence_transformers(kb) -> None:
    """`kb query TEXT` is the interactive path: what it imports is its start-up time (issue: instant queries)."""
    kb.write_kernel(make_kernel(0))
    kb.close()
    probe = ("import sys\nfrom cli.main import app\ntry:\n    app(['query', 'sliding window softcap', '-k', '2', '--json'])\n"
             "except SystemExit as e:\n    assert not e.code, e.code\n"
             "heavy = sorted(m for m in ('torch', 'sentence_transformers', 'transformers', 'sklearn') if m in sys.modules)\n"
             "print('HEAVY', heavy, file=sys.stderr)\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=subprocess_env(KB_HOME=str(kb.settings.home)))
    assert run.returncode == 0, run.stderr
    assert '"kernels"' in run.stdout and "HEAVY []" in run.stderr
