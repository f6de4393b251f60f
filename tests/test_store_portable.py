"""Exports you can trust: a footer with the record count and a digest; `kb import` refuses a truncated or altered file,
a value of the wrong type or out of range, and imports nothing of it; exports from before the footer import with a
warning. Real files and real `kb` processes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import text

from kb.settings import load_settings
from kb.store import GenerationRun, Kernel, PerfRecord, open_kb
from kb.store.portable import FOOTER
from tests.support.repo import KB_CLI, REPO, subprocess_env
from tests.support.store import (
    edit_export,
    make_kernel,
    make_measured,
    make_reported,
    make_run_records,
    make_snippets,
    make_source,
    make_tunable,
)


def _kb(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KB_CLI, "--home", str(home), *args], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)


def _refused(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 1 and "Traceback" not in res.stderr + res.stdout, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kb: error: ") and needle in lines[0], res.stderr


def _rows(home: Path) -> int:
    """Rows in the KB at `home` (0 when the import created it and wrote nothing)."""
    res = _kb(home, "stats", "--json")
    assert res.returncode == 0, res.stderr
    return sum(json.loads(res.stdout)["rows"].values())


@pytest.fixture
def export(tmp_path: Path, embedder) -> Path:
    """An export of a KB holding a row of every table (10 records)."""
    with open_kb(load_settings(home=tmp_path / "src"), embedder=embedder) as kb:
        src = kb.write_source(make_source())
        kid = kb.write_kernel(make_kernel(0, src), snippets=make_snippets(0, src)[:1], tunables=[make_tunable(0, src)],
                              perf=[make_measured(""), make_reported("")])
        kb.write_records(list(make_run_records(kid)))
        kb.export_jsonl(tmp_path / "kb.jsonl")
    return tmp_path / "kb.jsonl"


def test_the_footer_counts_and_digests_the_records(export: Path) -> None:
    lines = export.read_text().splitlines()
    footer = json.loads(lines[-1])
    assert footer["table"] == FOOTER and footer["data"]["records"] == len(lines) - 2 == 9
    assert footer["data"]["tables"]["kernels"] == 1 and len(footer["data"]["sha256"]) == 64


def test_an_export_cut_at_a_line_boundary_is_refused_whole(export: Path, tmp_path: Path) -> None:
    lines = export.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:-3]))  # the footer and two records gone, every line whole
    _refused(_kb(tmp_path / "kb", "import", str(cut)), "is truncated: it ends at line 8 without the export's footer")
    assert _rows(tmp_path / "kb") == 0
    cut.write_text("".join(lines)[:-40])  # cut inside the footer line
    _refused(_kb(tmp_path / "kb", "import", str(cut)), "is truncated")
    assert _rows(tmp_path / "kb") == 0


def test_an_altered_export_is_refused_whole(export: Path, tmp_path: Path) -> None:
    altered = tmp_path / "altered.jsonl"
    altered.write_text(export.read_text().replace('"ms": 1.5', '"ms": 0.5'))
    _refused(_kb(tmp_path / "kb", "import", str(altered)), "was altered after export")
    lines = export.read_text().splitlines(keepends=True)
    altered.write_text("".join(lines[:3] + lines[4:]))  # one record line dropped, the footer kept
    _refused(_kb(tmp_path / "kb", "import", str(altered)), "holds 8 records where its footer says 9")
    assert _rows(tmp_path / "kb") == 0


@pytest.mark.parametrize("schema,needle", [
    ('"2"', "the header's schema_version is '2', not an integer"),
    ("true", "the header's schema_version is True, not an integer"),
    ("99", "exported with schema version 99, this kernel-kb reads up to"),
])
def test_a_bad_header_says_what_is_wrong(tmp_path: Path, schema: str, needle: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f'{{"table": "kb_meta", "data": {{"format": "kernel-kb-export", "schema_version": {schema}}}}}\n')
    _refused(_kb(tmp_path / "kb", "import", str(bad)), needle)


@pytest.mark.parametrize("table,column,value,needle", [
    ("attempts", "n", 2**70, "n is 1180591620717411303424, not an integer within 64 bits"),
    ("perf_records", "ms", float("nan"), "ms is nan, not a finite number"),
    ("kernels", "verified", "yes", "verified is 'yes', not true or false"),
    ("kernels", "head_dim", "128", "head_dim is '128', not an integer within 64 bits"),
    ("generation_runs", "started_at", "yesterday", "started_at is 'yesterday', not an ISO date-time"),
    ("snippets", "colour", "red", "colour is not a column of snippets"),
])
def test_every_field_is_type_and_range_checked(export: Path, tmp_path: Path, table: str, column: str, value: object,
                                               needle: str) -> None:
    def damage(records: list[dict]) -> list[dict]:
        next(r for r in records if r["table"] == table)["data"][column] = value
        return records

    edit_export(export, damage)
    res = _kb(tmp_path / "kb", "import", str(export))
    _refused(res, needle)
    assert f"{export}:" in res.stderr and f"bad {table} record" in res.stderr
    assert _rows(tmp_path / "kb") == 0


def test_an_export_from_before_the_footer_imports_with_a_warning(export: Path, tmp_path: Path) -> None:
    """Schema 2 wrote no footer and no `quarantine` column; such a file still imports, saying it cannot be checked."""
    lines = export.read_text().splitlines()
    header = json.loads(lines[0])
    header["data"]["schema_version"] = 2
    old = []
    for line in lines[1:-1]:
        rec = json.loads(line)
        rec["data"].pop("quarantine", None)
        old.append(json.dumps(rec))
    legacy = tmp_path / "legacy.jsonl"
    legacy.write_text("\n".join([json.dumps(header), *old]) + "\n")
    res = _kb(tmp_path / "kb", "import", str(legacy))
    assert res.returncode == 0 and "imported 9 records" in res.stdout, res.stderr
    assert "written before exports carried a record count and digest" in res.stderr and "`kb export`" in res.stderr
    assert _rows(tmp_path / "kb") == 9


def test_export_import_export_gives_the_same_file_body(export: Path, tmp_path: Path, embedder) -> None:
    with open_kb(load_settings(home=tmp_path / "copy"), embedder=embedder) as kb:
        assert sum(kb.import_jsonl(export).values()) == 9
        kb.export_jsonl(tmp_path / "again.jsonl")
    assert export.read_text().splitlines()[1:] == (tmp_path / "again.jsonl").read_text().splitlines()[1:]


def test_quarantined_rows_travel_with_their_reason(tmp_path: Path, embedder) -> None:
    with open_kb(load_settings(home=tmp_path / "a"), embedder=embedder) as kb:
        kid = kb.write_kernel(make_kernel(0))
        with kb.engines.write.begin() as conn:  # a lesson an older kernel-kb stored, whose features are not typed
            conn.execute(text("INSERT INTO lessons (id, run_id, kind, text, features_json, created_at, quarantine) "
                              "VALUES ('l-old', NULL, 'fix', 'bound the loop', '{\"gqa_ratio\": \"4\"}', "
                              "'2026-01-01 00:00:00', '')"))
        assert kb.doctor(fix=True).fixed and kb.doctor().quarantined == {"lessons": 1}
        kb.export_jsonl(tmp_path / "q.jsonl")
    with open_kb(load_settings(home=tmp_path / "b"), embedder=embedder) as kb:
        kb.import_jsonl(tmp_path / "q.jsonl")
        assert kb.get("l-old").quarantine.startswith("invalid_record: features_json holds typed features")
        assert kb.usable(Kernel) == [kb.get(kid)] and kb.counts().vectors["lessons"] == 0  # never embedded
        report = kb.doctor()
        assert report.ok and report.quarantined == {"lessons": 1}


def test_credentials_stored_by_an_older_kernel_kb_are_not_exported(tmp_path: Path, embedder) -> None:
    with open_kb(load_settings(home=tmp_path / "a"), embedder=embedder) as kb:
        run_id = kb.write_run(GenerationRun(spec_path="s.py", status="failed"))
        kid = kb.write_kernel(make_kernel(0), perf=[make_measured("")])
        with kb.engines.write.begin() as conn:  # as written before redaction existed
            conn.execute(text("UPDATE generation_runs SET error = 'cannot connect to http://me:hunter2@llm:8000/v1' "
                              "WHERE id = :id"), {"id": run_id})
            conn.execute(text("UPDATE perf_records SET command = 'bench --db postgresql://kb:hunter2@db/kb'"))
        kb.export_jsonl(tmp_path / "x.jsonl")
        assert kb.list(PerfRecord, kernel_id=kid)[0].command.count("hunter2") == 1  # the KB itself is untouched
    exported = (tmp_path / "x.jsonl").read_text()
    assert "hunter2" not in exported and "http://me:***@llm:8000/v1" in exported and "kb:***@db/kb" in exported
