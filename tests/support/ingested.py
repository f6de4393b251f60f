"""The session's KB with the whole pinned corpus ingested, built once per test run.

pytest-xdist workers share the run's base temp directory: whoever takes the lock first builds the home there, the
others wait for it and read it (tests copy it before writing). With workers, the controller starts a builder process
at session start (`python -m tests.support.ingested SHARED_DIR`, see conftest), which takes the lock before its slow
imports: the workers then run other tests while the KB is built instead of one of them idling on the lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from tests.support.repo import TEST_CACHE

__all__ = ["shared_ingested", "private_copy", "HOME_NAME"]

HOME_NAME = "kb-ingested"


def shared_ingested(shared: Path, embedder: Callable[[], Any]) -> tuple[Path, Any]:
    """(the ingested KB home under `shared`, its IngestSummary), built here unless another process built it;
    `embedder()` gives the embedding model, asked for only when this process builds."""
    home, summary = shared / HOME_NAME, shared / f"{HOME_NAME}.summary.pickle"
    with open(shared / f"{HOME_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not summary.exists():
            shutil.rmtree(home, ignore_errors=True)  # a process that died mid-build left no summary
            summary.write_bytes(pickle.dumps(_ingest_all(home, embedder())))
    return home, pickle.loads(summary.read_bytes())


@contextlib.contextmanager
def private_copy(ingested_home: Path, where: Path) -> Iterator[Path]:
    """A copy of the ingested KB at `where`/kb for a module-scoped fixture, with every KB_* variable cleared while it
    is used (module fixtures run before the autouse per-test environment isolation)."""
    import pytest

    home = where / "kb"
    shutil.copytree(ingested_home, home)
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("KB_")]:
            mp.delenv(name)
        yield home


def _ingest_all(home: Path, embedder: Any) -> Any:
    from ingest.manifest import list_manifests
    from ingest.run import ingest
    from kb.settings import load_settings
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


def _embedder() -> Any:
    from kb.embed import get_embedder
    from kb.settings import Settings

    return get_embedder(Settings())


if __name__ == "__main__":
    shared_ingested(Path(sys.argv[1]), _embedder)
