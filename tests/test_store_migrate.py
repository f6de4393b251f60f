"""A KB written by an older kernel-kb is migrated in place, keeping every row."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import text

from kb.settings import load_settings
from kb.store import PerfRecord, open_kb
from kb.store.models import SCHEMA_VERSION
from tests.support.store import make_kernel, make_measured, make_source


def _make_v1(home: Path, embedder) -> str:  # noqa: ANN001
    """A KB as schema 1 left it: perf_records without arch/design_json, schema_version 1."""
    with open_kb(load_settings(home=home), embedder=embedder) as kb:
        kid = kb.write_kernel(make_kernel(0, kb.write_source(make_source())))
        kb.write_perf([make_measured(kid)])
        with kb.engines.write.begin() as con:
            con.execute(text("DROP INDEX ix_perf_records_arch"))
            con.execute(text("ALTER TABLE perf_records DROP COLUMN arch"))
            con.execute(text("ALTER TABLE perf_records DROP COLUMN design_json"))
            con.execute(text("UPDATE kb_meta SET value = '1' WHERE key = 'schema_version'"))
    return kid


def test_schema_1_is_migrated_in_place(tmp_path: Path, embedder) -> None:  # noqa: ANN001
    kid = _make_v1(tmp_path, embedder)
    with open_kb(load_settings(home=tmp_path), embedder=embedder) as kb:
        (old,) = kb.list(PerfRecord, kernel_id=kid)
        assert (old.arch, old.design_json, old.ms) == ("", "{}", 1.5)
        rec = make_measured(kid)
        rec.arch, rec.design_json, rec.ms = "sm90", json.dumps({"block_m": 128, "block_n": 64}), 1.2
        kb.write_perf([rec])
        assert {r.arch for r in kb.list(PerfRecord, kernel_id=kid)} == {"", "sm90"}
        with kb.engines.read.connect() as con:
            assert con.execute(text("SELECT value FROM kb_meta WHERE key = 'schema_version'")).scalar() == str(SCHEMA_VERSION)
