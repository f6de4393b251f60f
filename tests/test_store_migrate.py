"""A KB written by an older kernel-kb is migrated in place, keeping every row."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import text

from kb.settings import load_settings
from kb.store import Kernel, PerfRecord, open_kb
from kb.store.models import QUARANTINABLE, SCHEMA_VERSION
from tests.support.store import make_kernel, make_measured, make_source


def _make_old(home: Path, embedder, version: int) -> str:
    """A KB as schema `version` left it: 2 has no `quarantine` columns; 1 also no perf_records.arch/design_json."""
    with open_kb(load_settings(home=home), embedder=embedder) as kb:
        kid = kb.write_kernel(make_kernel(0, kb.write_source(make_source())))
        kb.write_perf([make_measured(kid)])
        with kb.engines.write.begin() as con:
            for table in QUARANTINABLE:
                con.execute(text(f"ALTER TABLE {table.__tablename__} DROP COLUMN quarantine"))
            if version == 1:
                con.execute(text("DROP INDEX ix_perf_records_arch"))
                con.execute(text("ALTER TABLE perf_records DROP COLUMN arch"))
                con.execute(text("ALTER TABLE perf_records DROP COLUMN design_json"))
            con.execute(text("UPDATE kb_meta SET value = :v WHERE key = 'schema_version'"), {"v": str(version)})
    return kid


def test_schema_1_is_migrated_in_place(tmp_path: Path, embedder) -> None:
    kid = _make_old(tmp_path, embedder, 1)
    with open_kb(load_settings(home=tmp_path), embedder=embedder) as kb:
        (old,) = kb.list(PerfRecord, kernel_id=kid)
        assert (old.arch, old.design_json, old.ms) == ("", "{}", 1.5)
        rec = make_measured(kid)
        rec.arch, rec.ms = "sm90", 1.2
        rec.design_json = json.dumps({"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3})
        kb.write_perf([rec])
        assert {r.arch for r in kb.list(PerfRecord, kernel_id=kid)} == {"", "sm90"}
        with kb.engines.read.connect() as con:
            assert con.execute(text("SELECT value FROM kb_meta WHERE key = 'schema_version'")).scalar() == str(SCHEMA_VERSION)


def test_schema_2_gains_quarantine_columns(tmp_path: Path, embedder) -> None:
    kid = _make_old(tmp_path, embedder, 2)
    with open_kb(load_settings(home=tmp_path), embedder=embedder) as kb:
        assert kb.get(kid).quarantine == "" and kb.usable(Kernel) == kb.list(Kernel)
        (rec,) = kb.list(PerfRecord, kernel_id=kid)
        assert rec.quarantine == "" and rec.ms == 1.5
        assert kb.doctor().ok
        with kb.engines.read.connect() as con:
            assert con.execute(text("SELECT value FROM kb_meta WHERE key = 'schema_version'")).scalar() == str(SCHEMA_VERSION)
