"""Database and Chroma targets: URL parsing, dialect selection, schema versions, bad files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import text

from kb.errors import KBError
from kb.settings import load_settings
from kb.store import SCHEMA_VERSION, open_kb
from kb.store.db import Dialect, make_engines, parse_db_url
from kb.store.vectors import parse_chroma_url


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


def test_other_embedding_model_is_refused(tmp_path: Path, embedder) -> None:
    open_kb(load_settings(home=tmp_path), embedder=embedder).close()
    with pytest.raises(KBError, match="built with 'all-MiniLM-L6-v2'"):
        open_kb(load_settings(home=tmp_path, embed_model="/models/other"))


# (a real PostgreSQL server: tests/test_store_postgres.py; a Chroma server: tests/test_store_chroma_server.py)
