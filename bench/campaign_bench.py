"""A generation campaign on Ray against the same specs run one after another, memory on and off (measuring only).

    .venv/bin/python bench/campaign_bench.py --seed-home .kb-demo [--specs FILES...] [--cpus 2]
                                             [--out bench/results/campaign.json]

Starts a Ray head on 127.0.0.1 with --cpus worker CPUs, a PostgreSQL server and, per run, a fresh database and Chroma
server seeded from the ingested KB at --seed-home (`kb export` / `kb import`, not timed), with the project's test
service scripts (tests/support/services.py). Each of four runs is one `kb generate --all DIR --no-backward --force
--json` from the shell, timed wall-clock: sequential and `--ray`, each with memory on and with `--no-memory`. Reports
per run: wall seconds, specs verified, attempts (summed), and per spec; plus the machine (CPUs, date). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.services import chroma_server, create_database, postgres_server, ray_head  # noqa: E402

DEFAULT_SPECS = [  # related variants in a row (bench/memory_bench.py's sequence): what one task learns, a later one uses
    "tests/data/specs/causal_where_d128.py", "examples/specs/chunked_prefill_bottom_right.py",
    "tests/data/specs/chunked_prefill_causal.py", "tests/data/specs/sliding_window_32.py",
    "examples/specs/sliding_window.py", "tests/data/specs/document_packed.py", "examples/specs/document_mask.py",
    "tests/data/specs/alibi_causal.py", "examples/specs/alibi.py", "examples/specs/decode_gqa_splitkv.py",
]
KB = [sys.executable, "-m", "cli.main"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    return env | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **extra}


def one_run(name: str, specs_dir: Path, work: Path, pg_url: str, seed: Path, ray: str | None, memory: bool) -> dict:
    chroma_dir = work / f"chroma-{name}"
    with chroma_server(chroma_dir) as chroma:
        env = _env(KB_HOME=str(work / f"home-{name}"), KB_DB_URL=create_database(pg_url, name),
                   KB_CHROMA_URL=chroma.url, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.environ["RAY_AUTH_TOKEN"])
        subprocess.run([*KB, "import", str(seed)], env=env, check=True, capture_output=True)
        args = [*KB, "generate", "--all", str(specs_dir), "--out", str(work / f"out-{name}"), "--no-backward",
                "--force", "--json", *([] if memory else ["--no-memory"]), *(["--ray", "--ray-address", ray] if ray else [])]
        t0 = time.perf_counter()
        res = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
    specs = json.loads(res.stdout)["specs"] if res.stdout.strip().startswith("{") else []
    print(f"{name:12s} {wall:7.1f} s  verified {sum(s['status'] == 'verified' for s in specs)}/{len(specs)}  "
          f"attempts {sum(s['attempts'] for s in specs)}", flush=True)
    return {"run": name, "ray": ray is not None, "memory": memory, "wall_s": round(wall, 1), "exit": res.returncode,
            "verified": sum(s["status"] == "verified" for s in specs), "specs": len(specs),
            "attempts": sum(s["attempts"] for s in specs),
            "per_spec": [{k: s[k] for k in ("spec", "status", "attempts", "seconds", "kernel_id")} for s in specs],
            "stderr_tail": res.stderr[-1500:] if res.returncode else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed-home", type=Path, required=True, help="an ingested embedded KB (e.g. .kb-demo)")
    ap.add_argument("--specs", nargs="*", default=DEFAULT_SPECS)
    ap.add_argument("--cpus", type=int, default=2, help="the Ray head's worker CPUs (tasks at once)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/campaign.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kb-campaign-"))
    specs_dir = work / "specs"
    specs_dir.mkdir()
    for s in args.specs:
        shutil.copy(ROOT / s, specs_dir / Path(s).name)
    seed = work / "seed.jsonl"
    subprocess.run([*KB, "export", str(seed)], env=_env(KB_HOME=str(args.seed_home)), check=True, capture_output=True)
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    runs = []
    with postgres_server() as pg_url, ray_head(args.cpus, _env(RAY_AUTH_MODE="token",
                                                                RAY_AUTH_TOKEN=os.environ["RAY_AUTH_TOKEN"])) as ray:
        for memory in (True, False):
            for on_ray in (False, True):
                name = f"{'ray' if on_ray else 'local'}_{'mem' if memory else 'nomem'}"
                runs.append(one_run(name, specs_dir, work, pg_url, seed, ray if on_ray else None, memory))
    doc = {"kind": "measured", "what": "kb generate --all over the specs, wall clock from the shell",
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
           "ray_worker_cpus": args.cpus, "specs": args.specs, "options": "--no-backward --force", "runs": runs,
           "command": "python bench/campaign_bench.py " + " ".join(sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
