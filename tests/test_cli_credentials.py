"""No credential is ever stored or printed: passwords in every URL (PostgreSQL, Chroma, the LLM endpoint) and the API
key never reach a `kb` process's output, its logs, the SQL rows, the embeddings, the reports or an export; malformed
URLs are one-line errors that do not echo them. Real processes: PostgreSQL, a Chroma server, the fake LLM over HTTP."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import chromadb
import pytest
from sqlalchemy.engine import make_url

from kb.ir.features import derive_features
from kb.ir.text import print_program
from kb.settings import Settings, load_settings
from kb.store import TABLES, Kernel, open_kb
from tests.support.fake_llm_server import FakeLLMServer, answer, http_error
from tests.support.ir_programs import plain
from tests.support.repo import KB_CLI, REPO, subprocess_env
from tests.support.services import chroma_server, free_port, postgres_server

PG_PASSWORD, CHROMA_PASSWORD, LLM_PASSWORD, API_KEY = "pg-S3cret-pw", "chroma-S3cret-pw", "llm-S3cret-pw", "sk-S3cret-key"
SECRETS = (PG_PASSWORD, CHROMA_PASSWORD, LLM_PASSWORD, API_KEY)


def _with_password(url: str, user: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


def _kb(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KB_CLI, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _no_secret(where: str, text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{leaked} in {where}: ...{text[max(0, text.find(leaked[0]) - 200):][:400]}..."


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_server() as url:  # trust authentication: the password is carried, never checked
        yield make_url(url).set(password=PG_PASSWORD).render_as_string(hide_password=False)


@pytest.fixture
def services(pg_url: str, tmp_path: Path, embedder) -> Iterator[tuple[Settings, dict[str, str], FakeLLMServer]]:
    """A KB on PostgreSQL + a Chroma server holding one reference program, and a `kb` environment for it."""
    with chroma_server(tmp_path / "chroma") as chroma, FakeLLMServer() as llm:
        settings = load_settings(home=tmp_path / "kb", db_url=pg_url,
                                 chroma_url=_with_password(chroma.url, "chromauser", CHROMA_PASSWORD))
        with open_kb(settings, embedder=embedder) as kb:
            program = plain()
            kb.write_kernel(Kernel(name="plain", family="fa2", ir_text=print_program(program), verified=True,
                                   features_json=derive_features(program).to_json()))
        (tmp_path / "tmp").mkdir()
        env = subprocess_env(KB_HOME=str(settings.home), KB_DB_URL=settings.db_url, KB_CHROMA_URL=settings.chroma_url,
                             KB_LLM_BASE_URL=_with_password(llm.base_url, "llmuser", LLM_PASSWORD),
                             KB_LLM_MODEL=llm.model, KB_LLM_API_KEY=API_KEY, KB_LLM_TIMEOUT_S="20",
                             TMPDIR=str(tmp_path / "tmp"))
        yield settings, env, llm
        with open_kb(settings, embedder=embedder) as kb:  # the next test gets an empty database
            with kb.engines.write.begin() as conn:
                for table in reversed(TABLES):
                    conn.exec_driver_sql(f"DELETE FROM {table.__tablename__}")


def _stored_text(settings: Settings, embedder) -> str:
    """Every SQL row and every Chroma document and metadata, as one text."""
    parts = []
    with open_kb(settings, embedder=embedder) as kb:
        for table in TABLES:
            parts += [json.dumps(r.model_dump(mode="json")) for r in kb.list(table)]
        target = kb.vectors.target
    client = chromadb.HttpClient(host=target.host, port=target.port)
    for col in client.list_collections():
        got = client.get_collection(col.name).get(include=["documents", "metadatas"])
        parts.append(json.dumps({"documents": got["documents"], "metadatas": got["metadatas"]}))
    return "\n".join(parts)


def test_no_password_reaches_output_rows_reports_logs_or_exports(services, tmp_path: Path, embedder) -> None:
    settings, env, llm = services
    spec = tmp_path / "causal.py"
    shutil.copy(REPO / "examples/specs/causal_d64.py", spec)
    seen: dict[str, str] = {}

    def run(name: str, *args: str, code: int = 0, **extra: str) -> subprocess.CompletedProcess:
        res = _kb(env | extra, *args)
        seen[f"{name} stdout"], seen[f"{name} stderr"] = res.stdout, res.stderr
        assert res.returncode == code, (name, res.stdout[-2000:], res.stderr[-2000:])
        assert "Traceback" not in res.stdout + res.stderr, name
        return res

    init = run("init", "init")
    assert f"kb:***@{make_url(settings.db_url).host}" in init.stdout and "chromauser" not in init.stdout

    llm.script(answer("I would rather not write IR."), http_error(500, "model overloaded"))
    gen = run("generate", "-v", "generate", str(spec), "--engine", "llm", "--out", str(tmp_path / "out"),
              "--no-backward", "--json", code=1)
    (result,) = json.loads(gen.stdout)["specs"]
    assert result["status"] == "failed" and "llmuser:***@127.0.0.1" in result["error"]
    assert len(llm.requests) == 2  # the failing attempt and the server error were both recorded

    closed = _with_password(f"http://127.0.0.1:{free_port()}/v1", "llmuser", LLM_PASSWORD)
    refused = run("generate, LLM down", "generate", str(spec), "--engine", "llm", "--out", str(tmp_path / "out2"),
                  "--no-backward", code=1, KB_LLM_BASE_URL=closed)
    assert "cannot connect to the LLM server at http://llmuser:***@127.0.0.1" in refused.stderr

    run("export", "export", str(tmp_path / "kb.jsonl"))
    run("stats", "stats")
    run("stats json", "stats", "--json")
    run("doctor", "doctor", "--json")
    run("show run", "show", result["run_id"])
    run("query", "query", "causal attention")
    wrong_db = make_url(settings.db_url).set(database="no_such_db").render_as_string(hide_password=False)
    assert "no_such_db" in run("database missing", "stats", code=1, KB_DB_URL=wrong_db).stderr
    down = _with_password(f"http://127.0.0.1:{free_port()}", "chromauser", CHROMA_PASSWORD)
    assert "cannot reach Chroma at http://127.0.0.1" in run("chroma down", "stats", code=1, KB_CHROMA_URL=down).stderr

    for name, text in seen.items():
        _no_secret(name, text)
    for f in sorted((tmp_path / "out").rglob("*")) + sorted((tmp_path / "out2").rglob("*")) + [tmp_path / "kb.jsonl"]:
        if f.is_file():
            _no_secret(str(f), f.read_text(errors="replace"))
    stored = _stored_text(settings, embedder)
    _no_secret("the SQL rows and Chroma documents", stored)
    assert "llmuser:***@127.0.0.1" in stored  # the run's error and its attempt name the server, redacted


@pytest.mark.parametrize("var,url,needle", [
    ("KB_DB_URL", f"postgresql://kb:{PG_PASSWORD}@localhost:notaport/db", "port is not a number"),
    ("KB_DB_URL", f"postgresql://kb:{PG_PASSWORD}@localhost:99999/db", "outside 1-65535"),
    ("KB_DB_URL", f"mysql://kb:{PG_PASSWORD}@localhost/db", "unsupported database 'mysql'"),
    ("KB_DB_URL", f"kb:{PG_PASSWORD}", "is not a database URL"),
    ("KB_DB_URL", f"postgresql://kb:{PG_PASSWORD}@localhost", "names no database"),
    ("KB_CHROMA_URL", f"http://u:{CHROMA_PASSWORD}@localhost:notaport", "invalid port"),
    ("KB_CHROMA_URL", f"http://u:{CHROMA_PASSWORD}@localhost:99999", "invalid port"),
    ("KB_CHROMA_URL", f"ftp://u:{CHROMA_PASSWORD}@localhost:8000", "not an http(s)://host:port URL"),
])
def test_a_malformed_url_is_one_line_without_its_password(tmp_path: Path, var: str, url: str, needle: str) -> None:
    res = _kb(subprocess_env(KB_HOME=str(tmp_path / "kb"), **{var: url}), "init")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kb: error: {var} ") and needle in lines[0], res.stderr
    _no_secret("the error", res.stderr + res.stdout)
