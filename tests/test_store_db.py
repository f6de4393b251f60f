"""Database and Chroma targets: URL parsing, dialect selection, schema versions, bad files, PostgreSQL."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
from sqlalchemy import text

from kb.errors import KBError
from kb.settings import load_settings
from kb.store import SCHEMA_VERSION, open_kb
from kb.store.db import Dialect, make_engines, parse_db_url
from kb.store.vectors import parse_chroma_url
from tests.helpers_store import make_kernel, make_snippets, make_source


def test_sqlite_url_is_default_under_home(tmp_path: Path) -> None:
    s = load_settings(home=tmp_path)
    target = parse_db_url(s.resolved_db_url)
    assert target.dialect is Dialect.SQLITE and target.path == tmp_path / "kb.sqlite"


@pytest.mark.parametrize(
    "url",
    ["postgresql://kb:secret@db.example:5433/kernels", "postgresql+psycopg2://kb@localhost/kernels", "postgres://u@h/d"],
)
def test_postgresql_urls_select_postgresql(url: str) -> None:
    target = parse_db_url(url)
    assert target.dialect is Dialect.POSTGRESQL and target.path is None
    assert "secret" not in target.display


def test_postgresql_engine_uses_psycopg2() -> None:
    engines = make_engines("postgresql://kb@localhost:1/kernels")
    assert engines.read.dialect.name == "postgresql" and engines.read.dialect.driver == "psycopg2"
    assert engines.read is engines.write


@pytest.mark.parametrize("url, msg", [("mysql://u@h/d", "unsupported database 'mysql'"), ("not a url", "not a database URL"), ("postgresql://u@h", "names no database")])
def test_bad_db_urls(url: str, msg: str) -> None:
    with pytest.raises(KBError, match=msg):
        parse_db_url(url)


def test_chroma_urls(tmp_path: Path) -> None:
    assert parse_chroma_url("", tmp_path).path == tmp_path
    t = parse_chroma_url("http://chroma.internal:8123", tmp_path)
    assert (t.host, t.port, t.ssl, t.path) == ("chroma.internal", 8123, False, None)
    assert parse_chroma_url("https://c.example", tmp_path).port == 443
    assert parse_chroma_url("localhost", tmp_path).port == 8000
    with pytest.raises(KBError, match="not an http"):
        parse_chroma_url("ftp://x:1", tmp_path)


def test_unreachable_chroma_is_one_kb_error(tmp_path: Path) -> None:
    s = load_settings(home=tmp_path, chroma_url="http://127.0.0.1:9")
    with pytest.raises(KBError, match="cannot reach Chroma at http://127.0.0.1:9"):
        open_kb(s)


def _bump_version(home: Path, version: int) -> None:
    with open_kb(load_settings(home=home)) as kb, kb.engines.write.begin() as conn:
        conn.execute(text("UPDATE kb_meta SET value = :v WHERE key = 'schema_version'"), {"v": str(version)})


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    _bump_version(tmp_path, SCHEMA_VERSION + 1)
    with pytest.raises(KBError, match=f"schema version {SCHEMA_VERSION + 1}, newer"):
        open_kb(load_settings(home=tmp_path))


def test_older_schema_without_migration_is_refused(tmp_path: Path) -> None:
    _bump_version(tmp_path, 0)
    with pytest.raises(KBError, match="older than .* no migration exists"):
        open_kb(load_settings(home=tmp_path))


def test_corrupt_database_file(tmp_path: Path) -> None:
    (tmp_path / "kb.sqlite").write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(KBError, match="not a usable kernel-kb database"):
        open_kb(load_settings(home=tmp_path))


def test_foreign_database_is_refused(tmp_path: Path) -> None:
    import sqlite3

    with sqlite3.connect(tmp_path / "kb.sqlite") as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER)")
    with pytest.raises(KBError, match="holds other tables"):
        open_kb(load_settings(home=tmp_path))


def test_unwritable_home(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(KBError, match="cannot use KB_HOME"):
        open_kb(load_settings(home=blocker / "kb"))


def test_missing_kb_without_create(tmp_path: Path) -> None:
    with pytest.raises(KBError, match="no knowledge base at"):
        open_kb(load_settings(home=tmp_path / "none"), create=False)
    assert not (tmp_path / "none").exists()


def test_other_embedding_model_is_refused(tmp_path: Path, embedder) -> None:  # noqa: ANN001
    open_kb(load_settings(home=tmp_path), embedder=embedder).close()
    with pytest.raises(KBError, match="built with 'all-MiniLM-L6-v2'"):
        open_kb(load_settings(home=tmp_path, embed_model="/models/other"))


# -- a real PostgreSQL server, when its binaries are installed ------------------------

def _pg_bin() -> Path | None:
    for d in [*sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True), Path("/usr/local/bin")]:
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    return None


@pytest.fixture(scope="module")
def pg_url():  # noqa: ANN201
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) not installed; `apt-get install postgresql` to run this")
    as_user: list[str] = []
    data = Path(tempfile.mkdtemp(prefix="kb-pg-"))
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser; cannot start PostgreSQL")
        try:
            shutil.chown(data, "postgres")
        except (LookupError, PermissionError):
            pytest.skip("running as root and there is no 'postgres' user to run the server")
        as_user = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = lambda *a: subprocess.run([*as_user, *map(str, a)], check=True, capture_output=True, timeout=120)  # noqa: E731
    run(bindir / "initdb", "-D", data / "db", "-A", "trust", "-U", "kb")
    run(bindir / "pg_ctl", "-D", data / "db", "-l", data / "log", "-w", "-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start")
    try:
        run(bindir / "createdb", "-h", "127.0.0.1", "-p", port, "-U", "kb", "kernels")
        yield f"postgresql+psycopg2://kb@127.0.0.1:{port}/kernels"
    finally:
        run(bindir / "pg_ctl", "-D", data / "db", "-m", "immediate", "stop")
        shutil.rmtree(data, ignore_errors=True)


def test_postgresql_round_trip(pg_url: str, tmp_path: Path, embedder) -> None:  # noqa: ANN001
    s = load_settings(home=tmp_path, db_url=pg_url)
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
