"""`kb generate --all DIR --ray` on a real cluster (issue 33): a Ray head on 127.0.0.1 with two worker CPUs, a
PostgreSQL database and a Chroma server holding the ingested KB. One worker is killed (SIGKILL) mid-task: its spec
is retried, its run is marked interrupted, every spec ends verified, `kb doctor` is clean, no kernel is written twice,
and the kernels equal those of a local run of the same specs. Then the tuning campaign times two specs as tasks with a
(logical) GPU each, in the CPU dry run."""

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

import pytest
from sqlalchemy import create_engine, text

from kb.procs import Owner
from kb.settings import load_settings
from kb.store import open_kb
from tests.support.repo import KB_CLI, REPO, subprocess_env
from tests.support.services import chroma_server, postgres_server, ray_head

SPECS = [REPO / "tests/data/specs_serving" / f"{n}.py" for n in
         ("paged_decode_softcap_window", "pool_decode_sinks", "varlen_prefix_causal", "chunked_prefill_causal_softcap")] + \
        [REPO / "tests/data/specs" / f"{n}.py" for n in ("softcap_plain", "alibi_causal")]
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


def _title(pid: int) -> str:
    ps = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True)
    return ps.stdout.strip()


@pytest.mark.network  # the session KB ingests the pinned releases
def test_a_ray_campaign_survives_a_killed_worker_and_equals_a_local_run(ingested_kb, tmp_path: Path) -> None:  # noqa: ANN001
    specs = tmp_path / "specs"
    specs.mkdir()
    for s in SPECS:
        shutil.copy(s, specs / s.name)
    dump = tmp_path / "kb.jsonl"
    ingested_kb.export_jsonl(dump)
    with postgres_server() as db_url, chroma_server(tmp_path / "chroma") as chroma:
        # token authentication (Ray's default for new clusters) with the token in the environment, as Ray's docs set it
        # up: the head, its workers and the driver share it; nothing is read from or written to ~/.ray
        env = subprocess_env(KB_HOME=str(tmp_path / "home"), KB_DB_URL=db_url, KB_CHROMA_URL=chroma.url,
                             RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        shared = load_settings(home=tmp_path / "home", db_url=db_url, chroma_url=chroma.url)
        with open_kb(shared, embedder=ingested_kb.embedder) as kb:  # the team KB: the ingested corpus, on the servers
            kb.import_jsonl(dump)

        def kb_cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([*KB_CLI, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)

        local = kb_cli("generate", "--all", "specs", "--out", "local", *OPTIONS)
        assert local.returncode == 0, local.stderr[-3000:]
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
        doctor = kb_cli("doctor", "--json")
        assert doctor.returncode == 0 and json.loads(doctor.stdout)["issues"] == [], doctor.stdout

        # kb tune --ray's campaign (generate.campaign.run_tune_campaign): one num_gpus=1 task per spec, here on the
        # head's one logical GPU with the CPU dry run of the timing code (the Triton interpreter, no measurement)
        assert tuned.returncode == 0, tuned.stderr[-3000:]
        docs, failures, retried = json.loads(tuned.stdout.splitlines()[-1])
        assert (failures, retried) == ([], 0)
        assert [[e["name"] for e in d["entries"]] for d in docs] == [["softcap_plain"], ["alibi_causal"]]
        assert all(d["env"]["dry_run"] == "cpu" and "error" not in d["entries"][0] for d in docs), docs


_TUNE_ON_RAY = """
import json, sys
from pathlib import Path
from generate.campaign import run_tune_campaign
from generate.tune import make_plan
from kb.settings import load_settings
from kb.store import open_kb

with open_kb(load_settings()) as kb:
    plan = make_plan(kb, ["specs/softcap_plain.py", "specs/alibi_causal.py"], Path("ray"), "sm90", max_designs=1)
print(json.dumps(run_tune_campaign(plan, address=sys.argv[1], device="cpu")))
"""
