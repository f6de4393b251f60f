"""The SQL side: engines for a database URL, the schema-version check, and write retries.

SQLite (the default) runs in WAL mode with a busy timeout, and write transactions
start with `BEGIN IMMEDIATE` so two processes never deadlock upgrading a read lock;
`retrying` re-runs a transaction that still hits "database is locked".
PostgreSQL is selected by the URL (`postgresql://` or `postgresql+psycopg2://`).
"""

from __future__ import annotations

import importlib.util
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

from sqlalchemy import event, inspect, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, IntegrityError, OperationalError
from sqlmodel import Session, SQLModel, create_engine, select

from kb.errors import KBError
from kb.redact import redact_text, redact_url
from kb.store.models import SCHEMA_VERSION, TABLES, Meta

__all__ = ["Dialect", "DbTarget", "parse_db_url", "Engines", "make_engines", "ensure_schema", "check_schema", "retrying",
           "driver_message", "MIGRATIONS"]

log = logging.getLogger(__name__)
T = TypeVar("T")

BUSY_TIMEOUT_MS = 30_000
WRITE_RETRIES = 8


class Dialect(StrEnum):
    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"


@dataclass(frozen=True)
class DbTarget:
    url: str
    dialect: Dialect
    path: Path | None  # the SQLite file; None for in-memory or server databases

    @property
    def display(self) -> str:
        """The URL without credentials, for messages."""
        return redact_url(self.url)


def parse_db_url(url: str) -> DbTarget:
    """Validate a SQLAlchemy URL and pick the dialect; `KBError` for anything unsupported (never echoing a password)."""
    try:
        parsed = make_url(url)
        port = parsed.port  # SQLAlchemy reads it lazily: a bad one raises here, not at connect
    except (ArgumentError, ValueError) as err:
        why = "its port is not a number" if isinstance(err, ValueError) else "it does not parse as dialect://user:password@host:port/database"
        raise KBError(f"KB_DB_URL {redact_url(url)} is not a database URL: {why}",
                      hint="e.g. sqlite:////path/kb.sqlite or postgresql://user:password@host:5432/db") from None
    if port is not None and not 0 < port < 65536:
        raise KBError(f"KB_DB_URL {redact_url(url)} has port {port}, outside 1-65535")
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        db = parsed.database
        path = Path(db).expanduser() if db and db != ":memory:" and not db.startswith("file:") else None
        return DbTarget(url, Dialect.SQLITE, path)
    if backend in ("postgresql", "postgres"):
        if not parsed.database:
            raise KBError(f"KB_DB_URL {redact_url(url)} names no database")
        driver = parsed.get_driver_name() if "+" in parsed.drivername else _pg_driver()
        parsed = parsed.set(drivername=f"postgresql+{driver}")
        return DbTarget(parsed.render_as_string(hide_password=False), Dialect.POSTGRESQL, None)
    raise KBError(f"KB_DB_URL {redact_url(url)} uses unsupported database {backend!r}", hint="use sqlite:/// or postgresql://")


def _pg_driver() -> str:
    """psycopg2 when installed (kernel-kb's dev extra), else psycopg 3 (SQLAlchemy 2.1's default)."""
    return "psycopg2" if importlib.util.find_spec("psycopg2") else "psycopg"


@dataclass(frozen=True)
class Engines:
    """`read` for queries; `write` for transactions (BEGIN IMMEDIATE on SQLite)."""

    target: DbTarget
    read: Engine
    write: Engine

    def dispose(self) -> None:
        self.read.dispose()
        if self.write is not self.read:
            self.write.dispose()


def _sqlite_engine(url: str, begin: str) -> Engine:
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (pysqlite's own is DEFERRED-only)
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        conn.exec_driver_sql(begin)

    return engine


def make_engines(url: str) -> Engines:
    target = parse_db_url(url)
    if target.dialect is Dialect.SQLITE:
        return Engines(target, _sqlite_engine(target.url, "BEGIN"), _sqlite_engine(target.url, "BEGIN IMMEDIATE"))
    try:
        engine = create_engine(target.url, pool_pre_ping=True)
    except ImportError as err:
        raise KBError(f"no driver for {target.display} ({redact_text(str(err))})", hint="pip install psycopg2-binary") from err
    return Engines(target, engine, engine)


# Step from version N to N+1, run inside one transaction. Versions without a step
# cannot be upgraded in place: export with the old kernel-kb and import here.
def _v1_to_v2(s: Session) -> None:
    """perf_records gain `arch` and `design_json` (measured designs); existing rows record none."""
    s.execute(text("ALTER TABLE perf_records ADD COLUMN arch VARCHAR NOT NULL DEFAULT ''"))
    s.execute(text("ALTER TABLE perf_records ADD COLUMN design_json VARCHAR NOT NULL DEFAULT '{}'"))
    s.execute(text("CREATE INDEX ix_perf_records_arch ON perf_records (arch)"))


def _v2_to_v3(s: Session) -> None:
    """Kernels, snippets, tunables, perf records and lessons gain `quarantine`; every existing row is in use."""
    for table in ("kernels", "snippets", "tunables", "perf_records", "lessons"):
        s.execute(text(f"ALTER TABLE {table} ADD COLUMN quarantine VARCHAR NOT NULL DEFAULT ''"))


MIGRATIONS: dict[int, Callable[[Session], None]] = {1: _v1_to_v2, 2: _v2_to_v3}


def _stored_version(engines: Engines) -> int | None:
    """The schema version in the database; None when it has no kernel-kb tables at all."""
    names = set(inspect(engines.read).get_table_names())
    if "kb_meta" not in names:
        if names & {m.__tablename__ for m in TABLES}:
            return 0  # kernel-kb tables from before versioning
        if names:
            raise KBError(f"{engines.target.display} holds other tables, not a kernel-kb database", hint="point KB_DB_URL or KB_HOME elsewhere")
        return None
    with Session(engines.read) as s:
        row = s.exec(select(Meta).where(Meta.key == "schema_version")).first()
    try:
        return int(row.value) if row else 0
    except ValueError:
        return 0


def driver_message(err: Exception) -> str:
    """A database driver's error as one line, with any credential in it redacted."""
    return " ".join(redact_text(str(getattr(err, "orig", None) or err)).split())


def _guard(engines: Engines, fn: Callable[[], T]) -> T:
    """Turn driver errors about the database itself into one-line `KBError`s."""
    try:
        return fn()
    except OperationalError as err:
        raise KBError(f"cannot use database {engines.target.display}: {driver_message(err)}",
                      hint="check KB_DB_URL / KB_HOME and that the server is reachable") from err
    except DatabaseError as err:
        raise KBError(f"{engines.target.display} is not a usable kernel-kb database ({driver_message(err)})",
                      hint="restore it from `kb export`, or move it away and run `kb init`") from err


def check_schema(engines: Engines) -> bool:
    """True if the database holds the current schema; False if it is empty. `KBError` otherwise."""
    version = _guard(engines, lambda: _stored_version(engines))
    if version is None:
        return False
    if version > SCHEMA_VERSION:
        raise KBError(
            f"{engines.target.display} has schema version {version}, newer than this kernel-kb's {SCHEMA_VERSION}",
            hint="upgrade kernel-kb",
        )
    if version < SCHEMA_VERSION:
        _migrate(engines, version)
    return True


def _migrate(engines: Engines, version: int) -> None:
    while version < SCHEMA_VERSION:
        step = MIGRATIONS.get(version)
        if step is None:
            raise KBError(
                f"{engines.target.display} has schema version {version}, older than {SCHEMA_VERSION}, and no migration exists",
                hint="run `kb export` with the kernel-kb that wrote it, then `kb import` into a fresh KB",
            )
        log.info("migrating schema %d -> %d", version, version + 1)
        with Session(engines.write) as s:
            step(s)
            s.merge(Meta(key="schema_version", value=str(version + 1)))
            s.commit()
        version += 1


def ensure_schema(engines: Engines) -> None:
    """Create the tables and stamp the schema version if the database is empty; else check it."""
    if check_schema(engines):
        return

    def create() -> None:
        SQLModel.metadata.create_all(engines.write, tables=[m.__table__ for m in (Meta, *TABLES)])  # type: ignore[attr-defined]
        with Session(engines.write) as s:
            if s.get(Meta, "schema_version") is None:
                s.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
            s.commit()

    _guard(engines, lambda: retrying(create))


def _transient(err: Exception) -> bool:
    if isinstance(err, IntegrityError):
        # Two writers inserted the same content-hash id at once (PostgreSQL); the retry sees the row.
        text = str(err.orig).lower()
        return "unique" in text or "duplicate" in text
    if isinstance(err, OperationalError):
        text = str(err.orig).lower()
        return "locked" in text or "busy" in text or "deadlock" in text or "could not serialize" in text
    return False


def retrying(fn: Callable[[], T], attempts: int = WRITE_RETRIES) -> T:
    """Run the transaction `fn`, re-running it on lock contention with jittered backoff."""
    for n in range(attempts):
        try:
            return fn()
        except (OperationalError, IntegrityError) as err:
            if not _transient(err) or n == attempts - 1:
                raise
            delay = min(2.0, 0.05 * 2**n) * (0.5 + random.random())
            log.warning("database busy (%s); retry %d in %.2fs", err.orig, n + 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
