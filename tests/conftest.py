"""Shared fixtures: one real embedding model per test session, a fresh KB per test."""

from __future__ import annotations

import os

# one thread per process: the run has a worker per core, and torch's OpenMP pool in every worker and every process a
# test starts (verify children, CLI runs, the KB builder: they inherit it) otherwise sizes itself to the whole machine;
# on 2 cores the spinning pools made each test of a full run several times slower than alone
os.environ["OMP_NUM_THREADS"] = "1"
# no GPU here: Triton runs under its interpreter, which it decides once per function when `@triton.jit` decorates it
# (its own library too, at the first import): set before any test module imports triton, so that the order in which
# modules are collected cannot matter (a subset that imported triton first failed with "Cannot call @triton.jit'd
# outside of the scope of a kernel"). The Triton compiles for sm_90 run in children without it (kb.lower.triton_aot).
os.environ["TRITON_INTERPRET"] = "1"

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kb.embed import SentenceEmbedder, get_embedder
from kb.settings import Settings, load_settings
from kb.store import open_kb
from tests.support.generate_fixtures import INGEST_SUMMARY
from tests.support.ingested import HOME_NAME, shared_ingested
from tests.support.repo import REPO

torch.set_num_threads(1)  # in case a plugin imported torch before the variable was set

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


_BUILDER: subprocess.Popen | None = None  # the controller's ingested-KB builder (pytest_sessionstart)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _BUILDER is not None and _BUILDER.poll() is None:  # no test needed the KB before the run ended
        _BUILDER.kill()
        _BUILDER.wait()
    shutil.rmtree(_RUN_CACHES, ignore_errors=True)

@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test sees the developer's KB: every KB_* variable is cleared, KB_HOME points into tmp_path."""
    for name in list(os.environ):
        if name.startswith("KB_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KB_HOME", str(tmp_path / "kb-home"))
    monkeypatch.setenv("KB_DESIGN_CACHE_DIR", str(tmp_path / "kb-designs"))  # the design choices modules keep
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
    with open_kb(kb_settings, embedder=embedder) as store:
        yield store


# ---- a KB holding the real ingested corpus, built once per session (generate/ingest tests)


@pytest.fixture(scope="session")
def ingested_home(tmp_path_factory: pytest.TempPathFactory, embedder) -> Path:
    """A KB home with the whole pinned corpus ingested (`kb ingest --all`; downloads cached in .kb-test-cache), built
    once per run (tests.support.ingested): with workers, in the run's base temp directory they share."""
    base = tmp_path_factory.getbasetemp()
    home, summary = shared_ingested(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base, lambda: embedder)
    INGEST_SUMMARY["all"] = summary
    return home


def pytest_sessionstart(session: pytest.Session) -> None:
    """With xdist workers, build the ingested KB in a process of its own from the start (tests.support.ingested)."""
    global _BUILDER
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    shared = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]  # the workers' basetemp parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")} | {"HF_HUB_OFFLINE": "1"}
    with open(shared / f"{HOME_NAME}.build.log", "w") as log:
        _BUILDER = subprocess.Popen([sys.executable, "-m", "tests.support.ingested", str(shared)], cwd=REPO, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture
def ingested_kb_settings(ingested_home: Path, tmp_path: Path) -> Settings:
    """A private copy of the ingested KB, so each test's write-back starts from the same state."""
    home = tmp_path / "kb"
    shutil.copytree(ingested_home, home)
    return load_settings(home=home)


@pytest.fixture
def ingested_kb(ingested_kb_settings: Settings, embedder) -> Iterator:
    with open_kb(ingested_kb_settings, embedder=embedder) as kb:
        yield kb
