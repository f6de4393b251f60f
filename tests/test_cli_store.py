"""The foundation CLI: init/stats/show/doctor/export/import, and bad input as one line, exit != 0."""

from __future__ import annotations

import importlib
import json
import sqlite3
import subprocess
import tomllib
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.main import app
from kb.settings import load_settings
from kb.store import Snippet, open_kb
from tests.support.repo import KB_CLI, REPO, subprocess_env
from tests.support.store import make_kernel, make_snippets, make_source

runner = CliRunner()


def kb_cli(home: Path, *args: str):
    return runner.invoke(app, ["--home", str(home), *args])


@pytest.fixture
def filled(tmp_path: Path, embedder) -> tuple[Path, str]:
    home = tmp_path / "kb"
    with open_kb(load_settings(home=home), embedder=embedder) as kb:
        src = kb.write_source(make_source())
        parent = kb.write_kernel(make_kernel(0, src), snippets=make_snippets(0, src))
        child = make_kernel(1, src)
        child.parent_id = parent
        kid = kb.write_kernel(child)
    return home, kid


def test_init_is_idempotent(tmp_path: Path) -> None:
    for _ in range(2):
        res = kb_cli(tmp_path / "kb", "init")
        assert res.exit_code == 0, res.output
        assert "kernel-kb ready" in res.output
    assert (tmp_path / "kb" / "kb.sqlite").is_file() and (tmp_path / "kb" / "chroma").is_dir()


def test_stats(filled) -> None:
    home, _ = filled
    res = kb_cli(home, "stats", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["rows"]["kernels"] == 2 and data["rows"]["snippets"] == 3 and data["vectors"]["kernels"] == 2
    assert "perf_records" in kb_cli(home, "stats").output


def test_show_kernel_prints_ir_features_provenance(filled) -> None:
    home, kid = filled
    res = kb_cli(home, "show", kid)
    assert res.exit_code == 0, res.output
    assert "program attn_1" in res.output  # IR text
    assert '"mask": "sliding_window"' in res.output  # features
    assert "provenance: synthetic-attn==1.0 (local) k1.py:1-5 lifter t1" in res.output
    assert "lineage: " + kid in res.output
    assert json.loads(kb_cli(home, "show", kid, "--json").output)["id"] == kid


def test_show_other_tables(filled) -> None:
    home, _ = filled
    with open_kb(load_settings(home=home)) as kb:
        snippet = kb.list(Snippet)[0]
    res = kb_cli(home, "show", snippet.id)
    assert res.exit_code == 0 and "Snippet " + snippet.id in res.output and f"kind: {snippet.kind}" in res.output


def test_doctor_and_fix(filled, embedder) -> None:
    home, kid = filled
    assert kb_cli(home, "doctor").exit_code == 0
    with open_kb(load_settings(home=home), embedder=embedder) as kb:
        kb.vectors.delete("kernels", [kid])
    res = kb_cli(home, "doctor")
    assert res.exit_code == 1 and "missing_embedding" in res.output and kid in res.output
    res = kb_cli(home, "doctor", "--fix")
    assert res.exit_code == 0 and "fixed: 1 missing embedding" in res.output
    assert json.loads(kb_cli(home, "doctor", "--json").output)["ok"] is True


def test_export_import(filled, tmp_path: Path) -> None:
    home, kid = filled
    dump = tmp_path / "dump.jsonl"
    res = kb_cli(home, "export", str(dump))
    assert res.exit_code == 0 and "exported 6 records" in res.output
    other = tmp_path / "other"
    res = kb_cli(other, "import", str(dump))
    assert res.exit_code == 0, res.output
    assert "imported 6 records" in res.output
    assert kid in kb_cli(other, "show", kid).output
    assert json.loads(kb_cli(other, "stats", "--json").output)["vectors"]["snippets"] == 3


def test_import_rejects_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"table": "kb_meta", "data": {"format": "kernel-kb-export", "schema_version": 1}}\n{"table": "widgets", "data": {}}\n')
    res = kb_cli(tmp_path / "kb", "import", str(bad))
    assert res.exit_code == 1 and "bad.jsonl:2: unknown table 'widgets'" in res.output
    bad.write_text('{"table": "kb_meta", "data": {"format": "kernel-kb-export", "schema_version": 99}}\n')
    assert "schema version 99" in kb_cli(tmp_path / "kb", "import", str(bad)).output


def test_console_script_is_the_app_with_every_command() -> None:
    """pyproject's `kb` entry point names this app; a user's `kb` has the same commands as `python -m cli.main`."""
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["kb"]
    module, attr = target.split(":")
    assert getattr(importlib.import_module(module), attr) is app
    names = {c.name for c in typer.main.get_command(app).commands.values()}
    assert {"init", "stats", "show", "doctor", "export", "import", "ingest", "query", "verify", "generate",
            "tune", "bench", "perf"} <= names


# -- bad input through a real `kb` process: one line on stderr, exit 1, no traceback ---

def _kb(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*KB_CLI, "--home", str(home), *args],
        cwd=REPO, env=subprocess_env(**env), capture_output=True, text=True, timeout=120,
    )


def _one_line_error(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kb: error: ") and needle in lines[0], res.stderr


def test_bad_inputs_one_line(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "kb.sqlite").write_bytes(b"\x00garbage" * 512)
    _one_line_error(_kb(corrupt, "stats"), "not a usable kernel-kb database")

    good = tmp_path / "good"
    assert _kb(good, "init").returncode == 0
    _one_line_error(_kb(good, "show", "k-0123456789abcdef"), "no record with id 'k-0123456789abcdef'")
    _one_line_error(_kb(good, "stats", KB_CHROMA_URL="http://127.0.0.1:9"), "cannot reach Chroma at http://127.0.0.1:9")

    blocker = tmp_path / "blocker"
    blocker.write_text("")
    _one_line_error(_kb(blocker / "kb", "init"), "cannot use KB_HOME")

    with sqlite3.connect(good / "kb.sqlite") as conn:
        conn.execute("UPDATE kb_meta SET value = '7' WHERE key = 'schema_version'")
    _one_line_error(_kb(good, "stats"), "schema version 7, newer")
    _one_line_error(_kb(tmp_path / "absent", "stats"), "no knowledge base at")
