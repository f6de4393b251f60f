"""Shared fixtures: one real embedding model per test session, a fresh KB per test."""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kb.embed import SentenceEmbedder, get_embedder
from kb.settings import Settings, load_settings
from tests.support.generate_fixtures import INGEST_SUMMARY
from tests.support.repo import TEST_CACHE

# ---- hermetic caches: a warm machine must not hide a failure (a kernel that only "compiles"
# because ~/.triton/cache already holds it). Every compiler cache of this run, and of every
# process it starts (they inherit the environment), lives in one fresh directory removed at exit.
_RUN_CACHES = Path(tempfile.mkdtemp(prefix="kb-test-caches-"))
for _var, _sub in (("TRITON_HOME", "triton-home"), ("TRITON_CACHE_DIR", "triton-cache"),
                   ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("XDG_CACHE_HOME", "xdg-cache"), ("TMPDIR", "tmp")):
    os.environ[_var] = str(_RUN_CACHES / _sub)
# temporary files too (pytest's tmp_path, the verifier's kb-verify-* directories, which `kb doctor` scans for orphans):
# another process's leftovers in the machine's /tmp must not change what a test sees
(_RUN_CACHES / "tmp").mkdir()
tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_RUN_CACHES, ignore_errors=True)

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


# ---- a KB holding the real ingested corpus, built once per session (generate/ingest tests)


@pytest.fixture(scope="session")
def ingested_home(tmp_path_factory: pytest.TempPathFactory, embedder) -> Path:  # noqa: ANN001
    """A KB home with the whole pinned corpus ingested (`kb ingest --all`; downloads cached in .kb-test-cache).

    Built once per run: pytest-xdist workers share the run's base temp directory, and the first worker to take
    the lock builds the home there while the others wait and read it (tests copy it before writing)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    home, summary = shared / "kb-ingested", shared / "kb-ingested.summary.pickle"
    with open(shared / "kb-ingested.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not summary.exists():
            shutil.rmtree(home, ignore_errors=True)  # a worker that died mid-build left no summary
            summary.write_bytes(pickle.dumps(_ingest_all(home, embedder)))
    INGEST_SUMMARY["all"] = pickle.loads(summary.read_bytes())
    return home


def _ingest_all(home: Path, embedder: SentenceEmbedder):  # noqa: ANN202
    from ingest.manifest import list_manifests
    from ingest.run import ingest
    from kb.store import open_kb

    old = os.environ.get("KB_CACHE_DIR")
    os.environ["KB_CACHE_DIR"] = str(TEST_CACHE)
    try:
        with open_kb(load_settings(home=home), embedder=embedder) as kb:
            return ingest(kb, [m.name for m in list_manifests()], progress=False)
    finally:
        if old is None:
            os.environ.pop("KB_CACHE_DIR", None)
        else:
            os.environ["KB_CACHE_DIR"] = old


@pytest.fixture
def ingested_kb_settings(ingested_home: Path, tmp_path: Path) -> Settings:
    """A private copy of the ingested KB, so each test's write-back starts from the same state."""
    home = tmp_path / "kb"
    shutil.copytree(ingested_home, home)
    return load_settings(home=home)


@pytest.fixture
def ingested_kb(ingested_kb_settings: Settings, embedder) -> Iterator:  # noqa: ANN001
    from kb.store import open_kb

    with open_kb(ingested_kb_settings, embedder=embedder) as kb:
        yield kb
