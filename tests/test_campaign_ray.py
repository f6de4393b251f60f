"""`kb generate --all DIR --ray` on a real cluster (issue 33): a Ray head on 127.0.0.1 with two worker CPUs, a
PostgreSQL database and a Chroma server holding the ingested KB. One worker is killed (SIGKILL) mid-task: its spec
is retried, its run is marked interrupted, every spec ends verified, `kb doctor` is clean, no kernel is written twice,
and the kernels equal those of a local run of the same specs. The KB's embeddings live on the Chroma server and queries are
answered there. Then the tuning campaign times a spec as a task with a (logical) GPU, in the CPU dry run."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import chromadb
import pytest
from chromadb.config import Settings as ChromaSettings
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from cli.main import app
from generate.campaign import ray_session
from kb.errors import KBError
from kb.procs import Owner
from kb.settings import load_settings
from kb.store import open_kb
from tests.support.repo import KB_CLI, REPO, subprocess_env
from tests.support.services import chroma_server, postgres_server, ray_head
from tests.support.store import export_without_snippets

# a paged decode and a dense spec: a serving program and a dense one (two, to keep the suite within its budget)
SPECS = [REPO / "tests/data/specs_serving" / "paged_decode_softcap_window.py", REPO / "tests/data/specs" / "softcap_plain.py"]
TASK_TITLE = "ray::_generate_task"  # what Ray names a worker process while it runs the campaign's task
# no memory: each kernel then depends on the ingested corpus alone, so the two runs must agree whatever the task order
OPTIONS = ("--no-memory", "--no-backward", "--force", "--json")


def _kill_a_worker_mid_run(campaign: subprocess.Popen, db_url: str) -> tuple[str, int] | None:
    """SIGKILL the worker of the first run the campaign records as running (so it is mid-task, past writing its run
    row); (run id, worker pid), or None when the campaign ended first."""
    engine = create_engine(db_url)
    try:
        while campaign.poll() is None:
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT id, error FROM generation_runs WHERE status = 'running'")).all()
            for run_id, note in rows:
                owner = Owner.parse(note)
                if owner is not None and _title(owner.pid) == TASK_TITLE:
                    os.kill(owner.pid, signal.SIGKILL)
                    return run_id, owner.pid
            time.sleep(0.1)
    finally:
        engine.dispose()
    return None


def _server_counts(port: int) -> dict[str, int]:
    """Embeddings per collection, asked of the Chroma server directly (not through kernel-kb)."""
    client = chromadb.HttpClient(host="127.0.0.1", port=port, settings=ChromaSettings(anonymized_telemetry=False))
    return {c: client.get_collection(c).count() for c in ("kernels", "snippets", "lessons")}


def _title(pid: int) -> str:
    ps = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True)
    return ps.stdout.strip()


@pytest.mark.network  # the session KB ingests the pinned releases
def test_a_ray_campaign_survives_a_killed_worker_and_equals_a_local_run(ingested_kb, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    specs = tmp_path / "specs"
    specs.mkdir()
    for s in SPECS:
        shutil.copy(s, specs / s.name)
    dump = tmp_path / "kb.jsonl"
    export_without_snippets(ingested_kb, dump)  # the programs, tunables, measurements and lessons: what generation reads
    with postgres_server() as db_url, chroma_server(tmp_path / "chroma") as chroma:
        # token authentication (Ray's default for new clusters) with the token in the environment, as Ray's docs set it
        # up: the head, its workers and the driver share it; nothing is read from or written to ~/.ray
        env = subprocess_env(KB_HOME=str(tmp_path / "home"), KB_DB_URL=db_url, KB_CHROMA_URL=chroma.url,
                             RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        shared = load_settings(home=tmp_path / "home", db_url=db_url, chroma_url=chroma.url)
        with open_kb(shared, embedder=ingested_kb.embedder) as kb:  # the team KB: the ingested corpus, on the servers
            kb.import_jsonl(dump)
        for name in ("KB_HOME", "KB_DB_URL", "KB_CHROMA_URL"):
            monkeypatch.setenv(name, env[name])
        # the embeddings live on the server, not in an embedded store under KB_HOME, and queries are answered there
        stats = json.loads(CliRunner().invoke(app, ["stats", "--json"]).stdout)
        assert _server_counts(chroma.port) == stats["vectors"] and stats["vectors"]["kernels"] == stats["rows"]["kernels"]
        assert not (tmp_path / "home" / "chroma").exists()
        found = CliRunner().invoke(app, ["query", str(SPECS[-1]), "-k", "3", "--json"])
        assert found.exit_code == 0 and all("embedding" in k["terms"] for k in json.loads(found.stdout)["kernels"])

        local = CliRunner().invoke(app, ["generate", "--all", str(specs), "--out", str(tmp_path / "local"), *OPTIONS])
        assert local.exit_code == 0, local.output[-3000:]
        with ray_head(num_cpus=2, num_gpus=1, env=env) as address:
            campaign = subprocess.Popen([*KB_CLI, "generate", "--all", "specs", "--out", "ray", *OPTIONS, "--ray",
                                         "--ray-address", address], env=env, cwd=tmp_path, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            killed = _kill_a_worker_mid_run(campaign, db_url)
            out, err = campaign.communicate(timeout=900)
            tuned = subprocess.run([sys.executable, "-c", _TUNE_ON_RAY, address], env=env | {"TRITON_INTERPRET": "1"},
                                   cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert killed is not None, f"no campaign task was seen running: {err[-3000:]}"
        assert campaign.returncode == 0, err[-3000:]
        assert "1 task(s) resubmitted after their Ray worker died" in err

        made = {Path(s["spec"]).name: s for s in json.loads(out)["specs"]}
        want = {Path(s["spec"]).name: s for s in json.loads(local.stdout)["specs"]}
        assert set(made) == {s.name for s in SPECS}
        assert all(s["status"] == "verified" for s in made.values()), made
        assert {n: s["kernel_id"] for n, s in made.items()} == {n: s["kernel_id"] for n, s in want.items()}
        for name, s in made.items():  # the same files as a local run writes, under --out
            assert Path(tmp_path, s["files"]["candidate"]).is_file() and s["files"]["candidate"].startswith("ray/")

        engine = create_engine(db_url)
        with engine.connect() as conn:
            runs = conn.execute(text("SELECT id, status, error FROM generation_runs")).all()
            hashes = conn.execute(text("SELECT count(*), count(DISTINCT content_hash) FROM kernels")).one()
        engine.dispose()
        assert {run: (st, e) for run, st, e in runs if st != "succeeded"} == {
            killed[0]: ("interrupted", "interrupted: its Ray worker died (WorkerCrashedError)")}
        assert sum(st == "succeeded" for _, st, _ in runs) == 2 * len(SPECS)  # the local run's and the campaign's
        assert hashes[0] == hashes[1]  # no kernel twice
        doctor = CliRunner().invoke(app, ["doctor", "--json"])  # this host's temp dirs too: the killed worker's is gone
        assert doctor.exit_code == 0 and json.loads(doctor.stdout)["issues"] == [], doctor.stdout

        # kb tune --ray's campaign (generate.campaign.run_tune_campaign): one num_gpus=1 task per spec, here on the
        # head's one logical GPU with the CPU dry run of the timing code (the Triton interpreter, no measurement)
        assert tuned.returncode == 0, tuned.stderr[-3000:]
        docs, failures, retried = json.loads(tuned.stdout.splitlines()[-1])
        assert (failures, retried) == ([], 0)
        assert [[e["name"] for e in d["entries"]] for d in docs] == [["softcap_plain"]]
        assert all(d["env"]["dry_run"] == "cpu" and "error" not in d["entries"][0] for d in docs), docs


_TUNE_ON_RAY = """
import json, sys
from pathlib import Path
from bench.gpu.tune import time_plan
from generate.campaign import run_tune_campaign
from generate.tune import make_plan
from kb.settings import load_settings
from kb.store import open_kb

with open_kb(load_settings()) as kb:
    plan = make_plan(kb, ["specs/softcap_plain.py"], Path("ray"), "sm90", max_designs=1)
print(json.dumps(run_tune_campaign(plan, timer=time_plan, address=sys.argv[1], device="cpu")))
"""


def test_a_campaign_needs_the_shared_kb_and_a_reachable_cluster(kb, tmp_path: Path) -> None:
    home = ["--home", str(kb.settings.home)]
    for args, says in [(["generate", str(SPECS[0]), "--ray"], "--ray needs the team's shared KB"),
                       (["generate", str(SPECS[0]), "--ray-address", "127.0.0.1:1"], "--ray-address is for --ray"),
                       (["tune", str(SPECS[0]), "--ray", "--plan", str(tmp_path / "p.json")], "--plan writes the work")]:
        res = CliRunner().invoke(app, [*home, *args])
        assert res.exit_code == 1 and "Traceback" not in res.output and says in res.output, res.output
    with pytest.raises(KBError, match=r"cannot reach the Ray cluster at 127\.0\.0\.1:1: Connection refused"), ray_session("127.0.0.1:1"):
        pass  # refused at once, not after Ray's own minutes of retrying
