"""Portable JSONL dumps: share a KB as one file and rebuild it anywhere.

Format: line 1 is `{"table": "kb_meta", "data": {"format": "kernel-kb-export",
"schema_version": N, ...}}`; every other line is `{"table": NAME, "data": {column: value}}`
with tables in dependency order and kernels parent-first. Embeddings are not exported:
import computes them with the importing KB's model.
Invariant: export -> import into an empty KB -> export gives the same records.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlmodel import SQLModel, select

import kb as kb_pkg
from kb.errors import KBError
from kb.store import writes
from kb.store.models import SCHEMA_VERSION, TABLE_BY_NAME, Kernel, utcnow
from kb.store.rules import check

if TYPE_CHECKING:
    from kb.store.kb import KnowledgeBase

__all__ = ["FORMAT", "export_jsonl", "import_jsonl", "parent_first"]

FORMAT = "kernel-kb-export"


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


def _rows(kb: KnowledgeBase) -> Iterator[tuple[str, SQLModel]]:
    with kb.read_session() as s:
        for name, model in TABLE_BY_NAME.items():  # in TABLES' dependency order
            if model is Kernel:
                kernels = parent_first(list(s.exec(select(Kernel))))
                _check_lineage(kernels)
                yield from ((name, k) for k in kernels)
            else:
                yield from ((name, r) for r in s.exec(select(model).order_by(model.id)))  # type: ignore[attr-defined]


def export_jsonl(kb: KnowledgeBase, path: Path) -> dict[str, int]:
    """Write every row to `path` (atomically); returns rows per table."""
    counts = {name: 0 for name in TABLE_BY_NAME}
    header = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "kernel_kb": kb_pkg.__version__, "exported_at": utcnow().isoformat()}
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"table": "kb_meta", "data": header}) + "\n")
            for table, row in _rows(kb):
                f.write(json.dumps({"table": table, "data": row.model_dump(mode="json")}, sort_keys=True) + "\n")
                counts[table] += 1
        os.replace(tmp, path)
    except OSError as err:
        raise KBError(f"cannot write {path}: {err.strerror or err}") from err
    finally:
        tmp.unlink(missing_ok=True)  # a failed export leaves no half-written file
    return counts


def _read(path: Path) -> dict[str, list[SQLModel]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise KBError(f"cannot read {path}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise KBError(f"{path} is not a kernel-kb export (not UTF-8 text)") from err
    out: dict[str, list[SQLModel]] = {name: [] for name in TABLE_BY_NAME}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            table, data = rec["table"], rec["data"]
        except (ValueError, KeyError, TypeError) as err:
            raise KBError(f"{path}:{n}: not a kernel-kb export record ({err})") from err
        if n == 1:
            _check_header(path, table, data)
            continue
        model = TABLE_BY_NAME.get(table)
        if model is None:
            raise KBError(f"{path}:{n}: unknown table {table!r}; known: {sorted(TABLE_BY_NAME)}")
        try:
            row = model.model_validate(data)
        except ValidationError as err:
            raise KBError(f"{path}:{n}: bad {table} record: {err.errors()[0]['loc']} {err.errors()[0]['msg']}") from err
        if not getattr(row, "id", ""):
            raise KBError(f"{path}:{n}: {table} record has no id")
        try:
            check(row)
        except KBError as err:
            raise KBError(f"{path}:{n}: {err}") from err
        out[table].append(row)
    if not lines:
        raise KBError(f"{path} is empty, not a kernel-kb export")
    return out


def _check_header(path: Path, table: str, data: Mapping) -> None:
    if table != "kb_meta" or data.get("format") != FORMAT:
        raise KBError(f"{path} is not a kernel-kb export (first line is not its header)")
    version = data.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise KBError(f"{path} was exported with schema version {version}, this kernel-kb reads up to {SCHEMA_VERSION}", hint="upgrade kernel-kb")


def import_jsonl(kb: KnowledgeBase, path: Path) -> dict[str, int]:
    """Upsert every record of `path` in one transaction, then embed what Chroma lacks.

    Returns rows per table. Importing the same file twice changes nothing.
    """
    tables = _read(path)
    kernels = parent_first([k for k in tables["kernels"] if isinstance(k, Kernel)])  # every row of that table
    ordered = [row for name in TABLE_BY_NAME for row in (kernels if name == "kernels" else tables[name])]
    try:
        writes.commit_rows(kb.engines, ordered)
    except IntegrityError as err:
        raise KBError(f"{path}: a record references a row that is neither in the file nor in the KB ({err.orig})") from err
    writes.embed_rows(kb, ordered)
    return {name: len(rows) for name, rows in tables.items()}
