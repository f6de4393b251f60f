"""The store on a real PostgreSQL server (one throwaway cluster for this module, a fresh database per test).

Embeddings stay in the embedded Chroma under each test's KB_HOME; what is checked here is the SQL side.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from cli.main import app
from kb.errors import KBError
from kb.redact import redact_url
from kb.settings import Settings, load_settings
from kb.store import SCHEMA_VERSION, Kernel, KnowledgeBase, PerfRecord, Snippet, open_kb
from kb.store.db import Dialect
from kb.store.doctor import DriftKind
from retrieve.hybrid import Filters, _db_version, query
from tests.support.repo import REPO, subprocess_env
from tests.support.store import (
    SNIPPETS_PER_KERNEL,
    make_kernel,
    make_measured,
    make_reported,
    make_run_records,
    make_snippets,
    make_source,
    make_tunable,
)
from tests.support.services import create_database, postgres_server

_names = itertools.count()


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    """The URL of a database on a fresh PostgreSQL cluster, for the whole module."""
    with postgres_server() as url:
        yield url


@pytest.fixture
def pg_url(pg_server: str) -> str:
    """A fresh, empty database on the module's server."""
    return create_database(pg_server, f"kb_test_{next(_names)}")


def _settings(home: Path, url: str) -> Settings:
    return load_settings(home=home, db_url=url)


@pytest.fixture
def pg_kb(pg_url: str, tmp_path: Path, embedder) -> Iterator[KnowledgeBase]:
    with open_kb(_settings(tmp_path / "kb", pg_url), embedder=embedder) as kb:
        assert kb.engines.target.dialect is Dialect.POSTGRESQL
        yield kb


def test_write_kernels_and_snippets_idempotently(pg_kb: KnowledgeBase) -> None:
    src = pg_kb.write_source(make_source())
    kid = pg_kb.write_kernel(make_kernel(0, src), snippets=make_snippets(0, src), tunables=[make_tunable(0, src)],
                             perf=[make_measured(""), make_reported("")])
    created = pg_kb.get(kid).created_at
    assert created.tzinfo is not None  # timestamptz survives the round trip through PostgreSQL
    before = pg_kb.counts()
    # the same kernel again, twice: same id, no new rows, no new embeddings, first timestamp kept
    for _ in range(2):
        assert pg_kb.write_kernel(make_kernel(0, src), snippets=make_snippets(0, src), tunables=[make_tunable(0, src)],
                                  perf=[make_measured(""), make_reported("")]) == kid
    assert pg_kb.counts() == before
    assert pg_kb.get(kid).created_at == created
    assert before.rows["kernels"] == 1 and before.rows["snippets"] == SNIPPETS_PER_KERNEL
    assert before.rows["tunables"] == 1 and before.rows["perf_records"] == 2
    assert before.vectors == {"kernels": 1, "snippets": SNIPPETS_PER_KERNEL, "lessons": 0}
    assert {s.kernel_id for s in pg_kb.list(Snippet)} == {kid}
    assert {p.kernel_id for p in pg_kb.list(PerfRecord)} == {kid}
    # a bundle PostgreSQL rejects (perf for an unknown kernel) leaves nothing behind, not even its kernel
    with pytest.raises(KBError, match="write rejected by the database"):
        pg_kb.write_kernel(make_kernel(1, src), perf=[make_measured("k-0000000000000000")])
    assert pg_kb.counts() == before
    assert pg_kb.doctor().ok


def test_postgresql_round_trip(pg_url: str, tmp_path: Path, embedder) -> None:
    s = _settings(tmp_path, pg_url)
    with open_kb(s, embedder=embedder) as kb:
        assert kb.engines.target.dialect is Dialect.POSTGRESQL
        src = kb.write_source(make_source())
        kid = kb.write_kernel(make_kernel(0, src), snippets=make_snippets(0, src))
        assert kb.write_kernel(make_kernel(0, src), snippets=make_snippets(0, src)) == kid
        assert kb.counts().rows["kernels"] == 1 and kb.counts().rows["snippets"] == 3
        assert kb.get(kid).created_at.tzinfo is not None
        assert kb.doctor().ok
        kb.export_jsonl(tmp_path / "pg.jsonl")
    with open_kb(s, embedder=embedder) as again:  # schema check on an existing PostgreSQL KB
        assert again.import_jsonl(tmp_path / "pg.jsonl")["kernels"] == 1
        assert again.counts().rows["kernels"] == 1


def test_concurrent_writers_lose_nothing(pg_url: str, tmp_path: Path, embedder) -> None:
    home = tmp_path / "kb"
    open_kb(_settings(home, pg_url), embedder=embedder).close()  # `kb init` first, as users do
    # three real processes; overlapping ranges: 4..7 and 8..11 are each written by two of them
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.store", str(home), str(start), "8"],
            cwd=REPO, env=subprocess_env(KB_DB_URL=pg_url), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for start in (0, 4, 8)
    ]
    results = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    written = {line.split()[1] for out, _ in results for line in out.splitlines() if line.startswith("committed")}
    assert len(written) == 16
    with open_kb(_settings(home, pg_url), embedder=embedder) as kb:
        assert {k.id for k in kb.list(Kernel)} == written
        assert len(kb.list(Snippet)) == 16 * SNIPPETS_PER_KERNEL
        report = kb.doctor()
        assert report.ok, report.summary()
        assert kb.counts().vectors == {"kernels": 16, "snippets": 16 * SNIPPETS_PER_KERNEL, "lessons": 0}


def test_doctor_finds_and_repairs_drift(pg_kb: KnowledgeBase) -> None:
    src = pg_kb.write_source(make_source())
    kids = [pg_kb.write_kernel(make_kernel(i, src), snippets=make_snippets(i, src)) for i in range(2)]
    assert pg_kb.doctor().ok
    pg_kb.vectors.delete("kernels", [kids[0]])  # an embedding lost
    with pg_kb.engines.write.begin() as conn:  # a kernel's text changed under its hash
        conn.execute(text("UPDATE kernels SET ir_text = ir_text || '\n' WHERE id = :id"), {"id": kids[1]})
    found = pg_kb.doctor()
    assert {(d.kind, d.id) for d in found.issues} == {
        (DriftKind.MISSING_EMBEDDING, kids[0]), (DriftKind.HASH_MISMATCH, kids[1]), (DriftKind.STALE_EMBEDDING, kids[1])}
    assert not found.fixed
    fixed = pg_kb.doctor(fix=True)  # the stale embedding leaves with its kernel, which is quarantined
    assert fixed.fixed and fixed.by_kind() == {DriftKind.MISSING_EMBEDDING: 1, DriftKind.HASH_MISMATCH: 1}
    assert pg_kb.doctor().ok and pg_kb.doctor().quarantined == {"kernels": 1}
    assert pg_kb.counts().vectors["kernels"] == 1
    assert pg_kb.get(kids[1]).quarantine.startswith("hash_mismatch:")  # its text changed under its id: set aside


def _fill(kb: KnowledgeBase) -> None:
    src = kb.write_source(make_source())
    kid = kb.write_kernel(make_kernel(0, src), snippets=make_snippets(0, src), tunables=[make_tunable(0, src)])
    child = make_kernel(1, src)
    child.parent_id, child.origin = kid, "generated"
    cid = kb.write_kernel(child, perf=[make_measured(""), make_reported("")])
    run, attempt, lesson = make_run_records(cid)
    kb.write_records([run, attempt, lesson])


def _records(path: Path) -> list[str]:
    return sorted(path.read_text().splitlines()[1:])  # line 1 is the header with its timestamp


def test_export_import_into_a_second_database(pg_kb: KnowledgeBase, pg_server: str, tmp_path: Path, embedder) -> None:
    _fill(pg_kb)
    first = tmp_path / "a.jsonl"
    counts = pg_kb.export_jsonl(first)
    assert all(n >= 1 for n in counts.values()), counts
    second_db = create_database(pg_server, f"kb_second_{next(_names)}")
    with open_kb(_settings(tmp_path / "second", second_db), embedder=embedder) as other:
        assert other.import_jsonl(first) == counts
        other.export_jsonl(tmp_path / "b.jsonl")
        assert _records(first) == _records(tmp_path / "b.jsonl")  # field for field, timestamps included
        assert other.counts().rows == pg_kb.counts().rows
        assert other.counts().vectors == {"kernels": 2, "snippets": SNIPPETS_PER_KERNEL, "lessons": 1}
        assert other.doctor().ok
        child = next(k for k in other.list(Kernel) if k.parent_id)
        assert [k.id for k in other.lineage(child.id)] == [child.id, child.parent_id]
        other.import_jsonl(first)  # again: nothing changes
        assert other.counts().rows == pg_kb.counts().rows


def test_newer_schema_version_is_refused(pg_url: str, tmp_path: Path, embedder) -> None:
    s = _settings(tmp_path / "kb", pg_url)
    with open_kb(s, embedder=embedder) as kb, kb.engines.write.begin() as conn:
        conn.execute(text("UPDATE kb_meta SET value = :v WHERE key = 'schema_version'"), {"v": str(SCHEMA_VERSION + 1)})
    shown = redact_url(pg_url)  # messages never carry user-info (kb.redact)
    with pytest.raises(KBError, match=re.escape(f"{shown} has schema version {SCHEMA_VERSION + 1}, newer than this kernel-kb's")):
        open_kb(s, embedder=embedder)
    # the CLI says the same on one line and exits 1
    res = CliRunner().invoke(app, ["stats"], env={"KB_HOME": str(tmp_path / "kb"), "KB_DB_URL": pg_url})
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.output.strip().splitlines() == [
        f"kb: error: {shown} has schema version {SCHEMA_VERSION + 1}, newer than this kernel-kb's {SCHEMA_VERSION} (upgrade kernel-kb)"]


def test_ranking_sees_kernels_another_writer_commits(pg_url: str, tmp_path: Path, embedder) -> None:
    """The ranking table is cached per process and re-read only when the WAL position moved (retrieve.hybrid's gate):
    a kernel committed by another connection is ranked by the next query, and an idle database costs no rescan."""
    settings = _settings(tmp_path / "kb", pg_url)
    with open_kb(settings, embedder=embedder) as reader, open_kb(settings, embedder=embedder) as writer:
        writer.write_kernel(make_kernel(0))
        names = lambda: {r.name for r in query(reader, "attention", None, k=50, filters=Filters(programs_only=False)).kernels}  # noqa: E731
        assert names() == {"attn_0"}
        with reader.read_session() as s:
            idle = _db_version(s)
        with reader.read_session() as s:
            assert _db_version(s) == idle
        writer.write_kernel(make_kernel(1))
        with reader.read_session() as s:
            assert _db_version(s) != idle
        assert names() == {"attn_0", "attn_1"}
