"""Portable JSONL dumps: share a KB as one file and rebuild it anywhere.

Format (`FORMAT`, one JSON object per line, each ending in a newline):
- line 1, the header: `{"table": "kb_meta", "data": {"format": "kernel-kb-export", "schema_version": N, ...}}`;
- then one `{"table": NAME, "data": {column: value}}` per row, tables in dependency order, kernels parent-first;
- last, the footer: `{"table": "kb_footer", "data": {"records": N, "tables": {NAME: n}, "sha256": HEX}}`, where
  HEX is the sha256 of the record lines' bytes exactly as written (newlines included), header and footer excluded.
Embeddings are not exported: import computes them with the importing KB's model. Credentials in free-text
columns are redacted (`kb.store.records.redact_record`); quarantined rows travel with their reason.

Import refuses, with one line and before writing anything, a file that does not check out: a footer missing
(truncated; exports from before schema version `FOOTER_SINCE` have none and import with a warning), a count
or digest that differs (cut or altered), a value of the wrong JSON type or out of range for its column, or a
record that breaks a rule (`kb.store.rules`, e.g. a kernel whose id is not its content hash). Then every
record is upserted in ONE transaction. The digest detects truncation and accidental change; it is no
signature (whoever edits the file can recompute it).
Invariant: export -> import into an empty KB -> export gives the same records and footer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlmodel import SQLModel, select

import kb as kb_pkg
from kb.errors import KBError
from kb.redact import redact_text
from kb.store import writes
from kb.store.handle import StoreHandle
from kb.store.models import QUARANTINABLE, SCHEMA_VERSION, TABLE_BY_NAME, Kernel, utcnow
from kb.store.records import FREE_TEXT, redact_record
from kb.store.rules import INT64, check

__all__ = ["FORMAT", "FOOTER", "FOOTER_SINCE", "export_jsonl", "import_jsonl", "parent_first"]

log = logging.getLogger(__name__)

FORMAT = "kernel-kb-export"
FOOTER = "kb_footer"
FOOTER_SINCE = 3  # exports with this schema version or later end with a footer


def parent_first(kernels: Sequence[Kernel]) -> list[Kernel]:
    """Kernels ordered so that a parent present in the list precedes its children."""
    by_id = {k.id: k for k in kernels}
    done: set[str] = set()
    out: list[Kernel] = []
    for k in sorted(kernels, key=lambda k: k.id):
        chain = []
        cur: Kernel | None = k
        while cur is not None and cur.id not in done and cur not in chain:
            chain.append(cur)
            cur = by_id.get(cur.parent_id) if cur.parent_id else None
        for c in reversed(chain):
            done.add(c.id)
            out.append(c)
    return out


def _check_lineage(kernels: list[Kernel]) -> None:
    """An export must import: every parent precedes its children (a cycle cannot be ordered)."""
    seen: set[str] = set()
    ids = {k.id for k in kernels}
    for k in kernels:
        if k.parent_id in ids and k.parent_id not in seen:
            raise KBError(f"kernel lineage has a cycle through {k.id} -> {k.parent_id}; nothing was exported",
                          hint="run `kb doctor --fix`, then export again")
        seen.add(k.id)


def _rows(kb: StoreHandle) -> Iterator[tuple[str, SQLModel]]:
    with kb.read_session() as s:
        for name, model in TABLE_BY_NAME.items():  # in TABLES' dependency order
            if model is Kernel:
                kernels = parent_first(list(s.exec(select(Kernel))))
                _check_lineage(kernels)
                yield from ((name, k) for k in kernels)
            else:
                yield from ((name, r) for r in s.exec(select(model).order_by(model.id)))  # type: ignore[attr-defined]


def _exported(row: SQLModel) -> dict:
    """The row as JSON values, credentials in its free-text columns redacted (rows from before redaction existed)."""
    data = row.model_dump(mode="json")
    for name in FREE_TEXT.get(type(row), ()):
        if isinstance(data.get(name), str):
            data[name] = redact_text(data[name])
    return data


def export_jsonl(kb: StoreHandle, path: Path) -> dict[str, int]:
    """Write every row to `path` (atomically), header first and footer last; returns rows per table."""
    counts = {name: 0 for name in TABLE_BY_NAME}
    header = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "kernel_kb": kb_pkg.__version__, "exported_at": utcnow().isoformat()}
    digest = hashlib.sha256()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8", newline="\n") as f:
            f.write(json.dumps({"table": "kb_meta", "data": header}) + "\n")
            for table, row in _rows(kb):
                line = json.dumps({"table": table, "data": _exported(row)}, sort_keys=True) + "\n"
                digest.update(line.encode("utf-8"))
                f.write(line)
                counts[table] += 1
            footer = {"records": sum(counts.values()), "tables": counts, "sha256": digest.hexdigest()}
            f.write(json.dumps({"table": FOOTER, "data": footer}, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        raise KBError(f"cannot write {path}: {err.strerror or err}") from err
    finally:
        tmp.unlink(missing_ok=True)  # a failed export leaves no half-written file
    return counts


# -- import: the file as a whole (header, footer), then each record (JSON types, then the rules)

def _lines(path: Path) -> list[str]:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise KBError(f"cannot read {path}: {err.strerror or err}") from err
    except UnicodeDecodeError:
        raise KBError(f"{path} is not a kernel-kb export (not UTF-8 text)") from None
    if not text.strip():
        raise KBError(f"{path} is empty, not a kernel-kb export")
    return text.split("\n")  # the last item is "" when the file ends in a newline


def _tagged(path: Path, n: int, line: str) -> tuple[str, object]:
    """(table, data) of line `n`; `KBError` unless it is a JSON object with a string `table` and a `data`."""
    try:
        rec = json.loads(line)
    except ValueError as err:
        raise KBError(f"{path}:{n}: not a kernel-kb export record (not JSON: {err})") from None
    if not isinstance(rec, dict) or set(rec) != {"table", "data"} or not isinstance(rec["table"], str):
        raise KBError(f"{path}:{n}: not a kernel-kb export record (an object with a string 'table' and 'data')")
    return rec["table"], rec["data"]


def _header_version(path: Path, lines: list[str]) -> int:
    table, data = _tagged(path, 1, lines[0])
    if table != "kb_meta" or not isinstance(data, dict) or data.get("format") != FORMAT:
        raise KBError(f"{path} is not a kernel-kb export (its first line is not an export header)")
    version = data.get("schema_version")
    if type(version) is not int:
        raise KBError(f"{path}:1: the header's schema_version is {version!r}, not an integer; "
                      "this file was not written by `kb export`")
    if version > SCHEMA_VERSION:
        raise KBError(f"{path} was exported with schema version {version}, this kernel-kb reads up to {SCHEMA_VERSION}",
                      hint="upgrade kernel-kb")
    if version < 1:
        raise KBError(f"{path}:1: the header's schema_version is {version}; versions start at 1")
    return version


def _body(path: Path, lines: list[str], version: int) -> list[tuple[int, str]]:
    """The record lines (number, text) between header and footer; checks the footer's count and digest."""
    last = len(lines) - 1
    while last > 0 and not lines[last].strip():
        last -= 1
    if version < FOOTER_SINCE:
        log.warning("%s was written before exports carried a record count and digest (schema version %d): a "
                    "truncated copy of it cannot be told from a whole one; once imported, `kb export` writes a checked "
                    "file", path, version)
        return [(n, lines[n - 1]) for n in range(2, last + 2) if lines[n - 1].strip()]
    truncated = f"{path} is truncated: it ends at line {last + 1} without the export's footer"
    if last == 0:
        raise KBError(f"{truncated}; nothing was imported", hint="export it again")
    try:
        table, footer = _tagged(path, last + 1, lines[last])
    except KBError:
        raise KBError(f"{truncated} (its last line is cut or not a record); nothing was imported",
                      hint="copy or export it again") from None
    if table != FOOTER:
        raise KBError(f"{truncated} (the last line is a {table!r} record); nothing was imported",
                      hint="copy or export it again")
    body = lines[1:last]
    count = footer.get("records") if isinstance(footer, dict) else None
    digest = footer.get("sha256") if isinstance(footer, dict) else None
    if type(count) is not int or not isinstance(digest, str):
        raise KBError(f"{path}:{last + 1}: the footer has no integer 'records' and string 'sha256'; nothing was imported")
    if count != len(body):
        raise KBError(f"{path} holds {len(body)} records where its footer says {count}: lines were cut or added; "
                      "nothing was imported", hint="copy or export it again")
    actual = hashlib.sha256("".join(line + "\n" for line in body).encode("utf-8")).hexdigest()
    if actual != digest:
        raise KBError(f"{path} was altered after export: its records' sha256 is {actual[:16]}…, its footer says "
                      f"{digest[:16]}…; nothing was imported", hint="copy or export it again")
    return list(enumerate(body, start=2))


# column type -> (what JSON value it needs, the test)
_JSON_TYPES: dict[object, tuple[str, Callable[[object], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an integer within 64 bits", lambda v: isinstance(v, int) and not isinstance(v, bool) and -INT64 <= v < INT64),
    float: ("a finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
    datetime: ("an ISO date-time", lambda v: isinstance(v, str) and _iso(v)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _type_problem(model: type[SQLModel], name: str, value: object) -> str | None:
    """Why `value` (from JSON) cannot be column `name` of `model`, or None."""
    field = model.model_fields.get(name)
    if field is None:
        return f"{name} is not a column of {model.__tablename__}"
    ann = field.annotation
    args = typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union else ()
    base = next((a for a in args if a is not type(None)), ann)
    want, test = _JSON_TYPES.get(base, _JSON_TYPES[str])
    if value is None:
        return None if type(None) in args else f"{name} is null, not {want}"
    if test(value):
        return None
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
    return f"{name} is {shown}, not {want}"


def _iso(value: str) -> bool:
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def _record(path: Path, n: int, line: str) -> tuple[str, SQLModel]:
    table, data = _tagged(path, n, line)
    model = TABLE_BY_NAME.get(table)
    if model is None:
        raise KBError(f"{path}:{n}: unknown table {table!r}; known: {sorted(TABLE_BY_NAME)}")
    if not isinstance(data, dict):
        raise KBError(f"{path}:{n}: the {table} record's data is not an object")
    problems = [p for name, value in data.items() if (p := _type_problem(model, name, value))]
    if problems:
        raise KBError(f"{path}:{n}: bad {table} record: {'; '.join(problems)}")
    try:
        row = model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        raise KBError(f"{path}:{n}: bad {table} record: {'.'.join(map(str, first['loc']))} {first['msg']}") from None
    if not getattr(row, "id", ""):
        raise KBError(f"{path}:{n}: {table} record has no id")
    redact_record(row)
    if not (model in QUARANTINABLE and getattr(row, "quarantine")):  # a quarantined row comes with its reason
        try:
            check(row)
        except KBError as err:
            raise KBError(f"{path}:{n}: {err}") from None
    return table, row


def _read(path: Path) -> dict[str, list[SQLModel]]:
    lines = _lines(path)
    version = _header_version(path, lines)
    out: dict[str, list[SQLModel]] = {name: [] for name in TABLE_BY_NAME}
    for n, line in _body(path, lines, version):
        table, row = _record(path, n, line)
        out[table].append(row)
    return out


def import_jsonl(kb: StoreHandle, path: Path) -> dict[str, int]:
    """Check the whole file, then upsert every record of `path` in one transaction, then embed what Chroma lacks.

    Returns rows per table. Importing the same file twice changes nothing.
    """
    tables = _read(path)
    kernels = parent_first([k for k in tables["kernels"] if isinstance(k, Kernel)])  # every row of that table
    ordered = [row for name in TABLE_BY_NAME for row in (kernels if name == "kernels" else tables[name])]
    try:
        writes.commit_rows(kb.engines, ordered)
    except IntegrityError as err:
        raise KBError(f"{path}: a record references a row that is neither in the file nor in the KB "
                      f"({' '.join(str(err.orig).split())}); nothing was imported") from err
    writes.embed_rows(kb, ordered)
    return {name: len(rows) for name, rows in tables.items()}

