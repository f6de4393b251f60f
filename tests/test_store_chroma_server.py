"""The KB on a real Chroma server (`KB_CHROMA_URL`): the server going away mid-write, stopped and restarted.

Each test starts its own `chroma run` (tests/support/services.py); the SQL side is the default SQLite under KB_HOME.
Ingesting, querying, generating and `kb doctor` against a Chroma server (with PostgreSQL) are in
tests/test_campaign_ray.py, which runs a whole campaign on them.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import chromadb
import pytest
from chromadb.config import Settings as ChromaSettings
from typer.testing import CliRunner

from cli.main import app
from kb.errors import KBError
from kb.settings import load_settings
from kb.store import open_kb
from tests.support.repo import REPO, subprocess_env
from tests.support.store import SNIPPETS_PER_KERNEL, make_kernel, make_snippets, make_source
from tests.support.services import ChromaServer, chroma_server

runner = CliRunner()
SPEC = REPO / "examples" / "specs" / "sliding_window.py"


@pytest.fixture
def chroma(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ChromaServer]:
    """A fresh Chroma server, and KB_CHROMA_URL pointing at it."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # `kb doctor` also scans the temp dir: this test's own
    with chroma_server(tmp_path / "chroma-server") as server:
        monkeypatch.setenv("KB_CHROMA_URL", server.url)
        yield server


def kb_cli(*args: str):
    return runner.invoke(app, list(args))


def doctor(*flags: str) -> tuple[int, dict]:
    """`kb doctor [flags] --json`: exit status and report."""
    res = kb_cli("doctor", *flags, "--json")
    return res.exit_code, json.loads(res.stdout)


def _server_counts(server: ChromaServer) -> dict[str, int]:
    """Embeddings per collection, asked of the server directly (not through kernel-kb)."""
    client = chromadb.HttpClient(host="127.0.0.1", port=server.port, settings=ChromaSettings(anonymized_telemetry=False))
    return {c: client.get_collection(c).count() for c in ("kernels", "snippets", "lessons")}


# A `kb` process whose Chroma server stops right after the SQL commit of its write, before any
# embedding is written (the moment `kb.store.writes.embed_rows` starts): the real server, really stopped.
_KB_LOSING_CHROMA_AFTER_COMMIT = """
import os, signal, sys
from kb.store import writes
from tests.support.services import wait_port_closed

embed = writes.embed_rows

def stop_chroma_then_embed(kb, records, force=False):
    os.killpg(int(os.environ["CHROMA_PID"]), signal.SIGTERM)
    wait_port_closed(int(os.environ["CHROMA_PORT"]))
    return embed(kb, records, force)

writes.embed_rows = stop_chroma_then_embed
from cli.main import main
sys.argv[0] = "kb"
main()
"""


def _sql_count(home: Path, table: str) -> int:
    with sqlite3.connect(home / "kb.sqlite") as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_chroma_stopping_mid_write_is_one_line_and_doctor_repairs(chroma: ChromaServer, tmp_path: Path, embedder) -> None:
    home = Path(load_settings().home)
    unreachable = f"kb: error: cannot reach Chroma at {chroma.url}"

    # through the API: the server stops between two writes; the second one's rows are committed anyway
    with open_kb(load_settings(), embedder=embedder) as kb:
        src = kb.write_source(make_source())
        kb.write_kernel(make_kernel(0, src), snippets=make_snippets(0, src))
        chroma.stop()
        with pytest.raises(KBError, match=f"cannot reach Chroma at {chroma.url}.*`kb doctor --fix` embeds them"):
            kb.write_kernel(make_kernel(1, src), snippets=make_snippets(1, src))
        assert _sql_count(home, "kernels") == 2
    chroma.restart()

    # through the CLI, a real process: `kb import` commits two more kernels, then Chroma stops before their embeddings
    with open_kb(load_settings(home=tmp_path / "scratch", chroma_url=""), embedder=embedder) as scratch:
        s = scratch.write_source(make_source())
        for i in (2, 3):
            scratch.write_kernel(make_kernel(i, s), snippets=make_snippets(i, s))
        scratch.export_jsonl(tmp_path / "two.jsonl")
    env = subprocess_env(KB_HOME=str(home), KB_CHROMA_URL=chroma.url, CHROMA_PID=str(chroma.pid), CHROMA_PORT=str(chroma.port))
    proc = subprocess.run([sys.executable, "-c", _KB_LOSING_CHROMA_AFTER_COMMIT, "import", str(tmp_path / "two.jsonl")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert not chroma.answers()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(unreachable), proc.stderr[-3000:]
    assert _sql_count(home, "kernels") == 4 and _sql_count(home, "snippets") == 4 * SNIPPETS_PER_KERNEL  # committed

    # while it is down, any command is the same one line (here the same import, refused before writing)
    res = kb_cli("import", str(tmp_path / "two.jsonl"))
    assert res.exit_code == 1 and res.output.strip().splitlines() == [res.output.strip()], res.output
    assert res.output.startswith(unreachable)

    # back up: doctor reports the missing embeddings, --fix embeds them, then doctor is clean
    chroma.restart()
    status, found = doctor()
    assert status == 1 and not found["ok"] and not found["fixed"], found
    assert {i["kind"] for i in found["issues"]} == {"missing_embedding"}
    assert sorted(i["table"] for i in found["issues"]) == ["kernels"] * 3 + ["snippets"] * 3 * SNIPPETS_PER_KERNEL
    status, fixed = doctor("--fix")
    assert status == 0 and fixed["fixed"] and fixed["issues"] == found["issues"], fixed
    assert doctor() == (0, {"ok": True, "fixed": False, "issues": [], "quarantined": {}})
    assert _server_counts(chroma) == {"kernels": 4, "snippets": 4 * SNIPPETS_PER_KERNEL, "lessons": 0}
