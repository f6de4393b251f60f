"""`kb serve` for real: a service process on 127.0.0.1 over a copy of the ingested KB, asked over HTTP and through
the `kb` CLI (KB_SERVICE_URL). Its answers equal what `kb` computes in its own process; tokens, bad requests, spec
text that tries to read secrets or the network, and concurrent clients."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from cli.main import app
from cli.service import is_loopback
from generate.spec_cache import TracedSpec
from tests.support.ingested import private_copy
from tests.support.procs import wait_for
from tests.support.repo import KB_CLI, REPO, subprocess_env
from tests.support.services import free_port

TOKEN = "svc-t0ken-S3cret"
SPEC = REPO / "examples" / "specs" / "prefix_lm.py"
TEXT = "sliding window with logit softcap"


@dataclass(frozen=True)
class Served:
    url: str
    env: dict[str, str]  # a `kb` client's environment: KB_SERVICE_URL and the token, no KB_HOME of its own
    local: dict[str, str]  # what `kb ... --json` printed in its own process before the service started
    kernel_id: str
    proc: subprocess.Popen


def _local(home: Path, *args: str) -> str:
    """What `kb ARGS` prints opening the KB in its own process (this one: the model is loaded already)."""
    res = CliRunner().invoke(app, list(args), env={"KB_HOME": str(home)})
    assert res.exit_code == 0, res.output
    return res.stdout


def _kb(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*KB_CLI, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def served(ingested_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    where = tmp_path_factory.mktemp("served")
    with private_copy(ingested_home, where) as home:
        (where / "tmp").mkdir()
        env = subprocess_env(KB_HOME=str(home), TMPDIR=str(where / "tmp"))
        local = {name: _local(home, *args) for name, args in
                 {"text": ("query", TEXT, "--json", "-k", "4"), "spec": ("query", str(SPEC), "--json", "-k", "4"),
                  "stats": ("stats", "--json")}.items()}
        kernel_id = json.loads(local["spec"])["kernels"][0]["id"]
        local["show"] = _local(home, "show", kernel_id)
        port = free_port()
        log = open(where / "serve.log", "w")  # a file, not a pipe nobody reads: the service never blocks on its log
        proc = subprocess.Popen([*KB_CLI, "serve", "--port", str(port), "--trace-timeout", "5"], cwd=REPO,
                                env={**env, "KB_SERVICE_TOKEN": TOKEN}, stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(url + "/v1/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_for(up, 240, proc)
            client = subprocess_env(KB_SERVICE_URL=url, KB_SERVICE_TOKEN=TOKEN, KB_HOME=str(where / "no-kb-here"))
            yield Served(url, client, local, kernel_id, proc)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    assert not list((where / "tmp").glob("kb-verify-*")), "the tracer's sandbox directory outlived the service"


def _post(served: Served, body: object, token: str | None = TOKEN, path: str = "/v1/query") -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(served.url + path, json=body, headers=headers, timeout=120)


def _one_line_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and "\n" not in body["error"] and "Traceback" not in body["error"]
    return body["error"]


class _Ranking(list):
    """(id, score) pairs, equal when the ids are and the scores agree to 1e-5: the embedding runs in numpy or torch
    depending on what the process has loaded (kb.bert), 1e-7 apart."""

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, list) and len(self) == len(other)
                and all(a[0] == b[0] and abs(a[1] - b[1]) < 1e-5 for a, b in zip(self, other)))

    __hash__ = None  # type: ignore[assignment]


def _ranking(answer: dict) -> _Ranking:
    return _Ranking((k["id"], k["score"]) for k in answer["kernels"])


def test_answers_equal_the_local_commands(served: Served) -> None:
    text = _post(served, {"text": TEXT, "k": 4}).json()
    spec = _post(served, {"spec": SPEC.read_text(), "filename": SPEC.name, "k": 4}).json()
    assert _ranking(text) == _ranking(json.loads(served.local["text"]))
    local_spec = json.loads(served.local["spec"])
    assert _ranking(spec) == _ranking(local_spec) and spec["target"] == local_spec["target"]
    assert spec["query"] == local_spec["query"] and spec["lessons"] == local_spec["lessons"]
    assert [(s["id"], s["kind"]) for s in spec["snippets"]] == [(s["id"], s["kind"]) for s in local_spec["snippets"]]
    upload = httpx.post(served.url + "/v1/query/file", files={"file": (SPEC.name, SPEC.read_bytes())}, data={"k": "4"},
                        headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    assert upload.status_code == 200 and _ranking(upload.json()) == _ranking(spec)


def test_cli_talks_to_the_service(served: Served) -> None:
    for args, local in (((str(SPEC), "--json", "-k", "4"), "spec"), ((TEXT, "--json", "-k", "4"), "text")):
        run = _kb(served.env, "query", *args)
        assert run.returncode == 0, run.stderr
        assert _ranking(json.loads(run.stdout)) == _ranking(json.loads(served.local[local]))
    table = _kb(served.env, "query", str(SPEC), "-k", "2")
    assert table.returncode == 0 and served.kernel_id in table.stdout and "query: prefix_lm mask" in table.stdout
    show = _kb(served.env, "show", served.kernel_id)
    assert show.returncode == 0 and show.stdout == served.local["show"]
    stats = _kb(served.env, "stats", "--json")
    assert json.loads(stats.stdout) == json.loads(served.local["stats"])
    missing = _kb(served.env, "show", "k-0000")
    assert missing.returncode == 1 and missing.stderr.startswith("kb: error: no record with id 'k-0000'")


def test_tokens(served: Served) -> None:
    assert httpx.get(served.url + "/v1/health").status_code == 200  # no token needed to see it is up
    assert "bearer token" in _one_line_error(_post(served, {"text": TEXT}, token=None), 401)
    _one_line_error(_post(served, {"text": TEXT}, token="wrong"), 401)
    _one_line_error(httpx.get(served.url + "/v1/stats"), 401)
    wrong = _kb({**served.env, "KB_SERVICE_TOKEN": "wrong"}, "stats")
    assert wrong.returncode == 1 and len(wrong.stderr.strip().splitlines()) == 1 and "KB_SERVICE_TOKEN" in wrong.stderr
    assert TOKEN not in wrong.stderr


def test_bad_requests_get_one_line_each(served: Served) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    _one_line_error(httpx.post(served.url + "/v1/query", content=b"{not json", headers=headers), 400)
    assert "-k must be between 1 and 100" in _one_line_error(_post(served, {"text": TEXT, "k": 0}), 400)
    assert "exactly one of text and spec" in _one_line_error(_post(served, {"text": TEXT, "spec": "x = 1"}), 400)
    assert "exactly one of text and spec" in _one_line_error(_post(served, {}), 400)
    assert "k" in _one_line_error(_post(served, {"text": TEXT, "k": "many"}), 400)
    assert "unknown --mode" in _one_line_error(_post(served, {"text": TEXT, "mode": "psychic"}), 400)
    assert "SyntaxError" in _one_line_error(_post(served, {"spec": "def broken(:\n", "filename": "b.py"}), 400)
    assert "not a spec" in _one_line_error(_post(served, {"spec": "x = 1\n"}), 400)
    assert "larger than" in _one_line_error(_post(served, {"spec": "#" * (300 * 1024)}), 400)
    assert "no record with id" in _one_line_error(httpx.get(served.url + "/v1/records/k-0000",
                                                            headers={"Authorization": f"Bearer {TOKEN}"}), 404)


def test_spec_text_runs_confined(served: Served) -> None:
    """Tracing runs the spec's code: it sees none of the service's settings and cannot reach the service."""
    port = served.url.rsplit(":", 1)[1]
    snoop = ("import os\nraise RuntimeError('env=' + os.environ.get('KB_SERVICE_TOKEN', 'none') + "
             "os.environ.get('KB_HOME', '-nohome'))\n")
    error = _one_line_error(_post(served, {"spec": snoop}), 400)
    assert "env=none-nohome" in error and TOKEN not in error
    dial = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
    assert "cannot import spec file" in _one_line_error(_post(served, {"spec": dial}), 400)
    assert "took longer than 5 s" in _one_line_error(_post(served, {"spec": "while True:\n    pass\n"}), 400)
    again = _post(served, {"spec": SPEC.read_text(), "filename": "again.py"})  # the worker still answers after a kill
    assert again.status_code == 200 and again.json()["target"]["mask"] == "prefix_lm"


def test_concurrent_clients_get_their_own_answers(served: Served) -> None:
    window = (REPO / "examples" / "specs" / "sliding_window.py")
    bodies = [{"text": TEXT, "k": 3}, {"spec": SPEC.read_text(), "k": 3},
              {"spec": window.read_text(), "filename": window.name, "k": 3}, {"text": "alibi bias gqa", "k": 3}]
    expected = [_ranking(_post(served, b).json()) for b in bodies]
    got: dict[int, list] = {}

    def client(i: int) -> None:
        response = _post(served, bodies[i % len(bodies)])
        got[i] = _ranking(response.json()) if response.status_code == 200 else [response.text]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert {i: got.get(i) for i in range(16)} == {i: expected[i % len(bodies)] for i in range(16)}


def test_serve_refuses_what_it_should_not_do(served: Served, tmp_path: Path) -> None:
    env = subprocess_env(KB_HOME=str(tmp_path / "kb"))
    open_host = _kb(env, "serve", "--host", "0.0.0.0", timeout=60)
    assert open_host.returncode == 1 and "KB_SERVICE_TOKEN" in open_host.stderr
    assert len(open_host.stderr.strip().splitlines()) == 1
    taken = _kb(env, "serve", "--port", served.url.rsplit(":", 1)[1], timeout=60)
    assert taken.returncode == 1 and "cannot listen on" in taken.stderr and len(taken.stderr.strip().splitlines()) == 1
    gone = _kb(subprocess_env(KB_SERVICE_URL=f"http://127.0.0.1:{free_port()}"), "stats", timeout=60)
    assert gone.returncode == 1 and "cannot reach the KB service" in gone.stderr
    assert served.proc.poll() is None


def test_tracer_answers_are_parsed_strictly() -> None:
    good = {"features": json.dumps({"mask": "causal", "head_dim": 64, "causal": True}), "mask_mod": "q >= kv"}
    assert TracedSpec.from_untrusted(good).features.head_dim == 64
    for bad in ('{"head_dim": "64"}', '{"causal": 1}', '{"gqa_ratio": true}', "[1]", "not json", None):
        with pytest.raises(ValueError):
            TracedSpec.from_untrusted({"features": bad})
    for bad_answer in ([good], {**good, "score_mod": 3}, {**good, "mask_mod": ["q"]}):
        with pytest.raises(ValueError):
            TracedSpec.from_untrusted(bad_answer)


def test_no_token_by_default_only_on_loopback() -> None:
    assert all(map(is_loopback, ("127.0.0.1", "127.8.0.1", "::1", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.1", "example.org")))
    assert os.environ.get("KB_SERVICE_TOKEN") is None  # the tests' own environment carries none
