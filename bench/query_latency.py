"""How long a user waits for `kb query` (not a test): from the shell, and through `kb serve`.

    .venv/bin/python bench/query_latency.py --home KB_HOME [--db-url URL --chroma-url URL] [--runs 5] [--requests 200]

From the shell (each a new process, median of --runs; with --cold the page cache is dropped before each): `python -c "import torch"` (the floor the issue measures
against), `kb query TEXT`, `kb query SPEC` with its trace not cached (a fresh KB_CACHE_DIR per run) and cached,
and the same two through a `kb serve` started on the KB (KB_SERVICE_URL). Then --requests HTTP requests to the
service, one at a time, cycling over the labelled specs of tests/data/specs: as text (their feature sentences), as
spec text seen for the first time (traced in the sandbox), and as spec text seen before; p50/p95 of each. Writes
one JSON object to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "specs" / "prefix_lm.py"
TEXT = "causal mask with logit softcap, head dim 128 bf16"
_SCRIPT = Path(sys.executable).parent / "kb"  # the console script, as a user runs it
KB = (str(_SCRIPT),) if _SCRIPT.is_file() else (sys.executable, "-m", "cli.main")


def _env(args: argparse.Namespace, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.update(KB_HOME=str(args.home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), **extra)
    if args.db_url:
        env.update(KB_DB_URL=args.db_url, KB_CHROMA_URL=args.chroma_url)
    return env


def _wall(argv: list[str] | tuple[str, ...], env: dict[str, str]) -> float:
    t = time.perf_counter()
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {run.stderr.strip()[-500:]}")
    return took


COLD = False  # --cold: the page cache is dropped before every timed run


def _drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as err:
        raise SystemExit(f"--cold needs to drop the page cache (root): {err}") from None


def _median(runs: int, argv: list[str] | tuple[str, ...], env_of) -> dict[str, float]:
    times = []
    for _ in range(runs):
        env = env_of()
        if COLD:
            _drop_page_cache()
        times.append(_wall(argv, env))
    return {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3), "max_s": round(max(times), 3)}


def _pcts(ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ms, n=100)
    return {"n": len(ms), "p50_ms": round(q[49], 1), "p95_ms": round(q[94], 1), "mean_ms": round(statistics.mean(ms), 1)}


def _fresh_cache() -> str:
    return tempfile.mkdtemp(prefix="kb-trace-cache-")


def shell_times(args: argparse.Namespace) -> dict[str, object]:
    res: dict[str, object] = {}
    res["import_torch"] = _median(args.runs, [sys.executable, "-c", "import torch"], lambda: _env(args))
    res["kb_query_text"] = _median(args.runs, [*KB, "query", TEXT, "-k", "3"], lambda: _env(args))
    res["kb_query_spec_traced"] = _median(args.runs, [*KB, "query", str(SPEC), "-k", "3"],
                                          lambda: _env(args, KB_CACHE_DIR=_fresh_cache()))
    cache = _fresh_cache()
    _wall([*KB, "query", str(SPEC), "-k", "3"], _env(args, KB_CACHE_DIR=cache))
    res["kb_query_spec_cached"] = _median(args.runs, [*KB, "query", str(SPEC), "-k", "3"],
                                          lambda: _env(args, KB_CACHE_DIR=cache))
    return res


def service_times(args: argparse.Namespace, res: dict[str, object]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(Path(tempfile.gettempdir()) / f"kb-serve-bench-{port}.log", "w")
    t = time.perf_counter()
    proc = subprocess.Popen([*KB, "serve", "--port", str(port)], cwd=ROOT, env=_env(args), stdout=log, stderr=log)
    try:
        while True:
            try:
                if httpx.get(url + "/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.perf_counter() - t > 300:
                raise SystemExit(f"kb serve did not start (see {log.name})")
            time.sleep(0.2)
        res["serve_ready_s"] = round(time.perf_counter() - t, 1)
        client = lambda: _env(args, KB_SERVICE_URL=url)  # noqa: E731
        _wall([*KB, "query", str(SPEC), "-k", "3"], client())  # the service traces it once
        res["kb_query_spec_via_service"] = _median(args.runs, [*KB, "query", str(SPEC), "-k", "3"], client)
        res["kb_query_text_via_service"] = _median(args.runs, [*KB, "query", TEXT, "-k", "3"], client)
        specs = sorted((ROOT / "tests" / "data" / "specs").glob("*.py"))
        with httpx.Client(base_url=url, timeout=120) as http:
            texts = []
            new_ms: list[float] = []
            seen_ms: list[float] = []
            text_ms: list[float] = []
            for i, path in enumerate(specs * (1 + args.requests // len(specs))):
                if i >= args.requests:
                    break
                body = {"spec": path.read_text(), "filename": path.name, "k": 5}
                t0 = time.perf_counter()
                answer = http.post("/v1/query", json=body)
                (new_ms if i < len(specs) else seen_ms).append((time.perf_counter() - t0) * 1000)
                answer.raise_for_status()
                if i < len(specs):
                    texts.append(answer.json()["query"])
            for i in range(args.requests):
                t0 = time.perf_counter()
                http.post("/v1/query", json={"text": texts[i % len(texts)], "k": 5}).raise_for_status()
                text_ms.append((time.perf_counter() - t0) * 1000)
            res["service_http"] = {"text": _pcts(text_ms), "spec_first_time": _pcts(new_ms),
                                   "spec_seen_before": _pcts(seen_ms) if len(seen_ms) > 1 else None}
            res["kernels"] = http.get("/v1/stats").json()["rows"]["kernels"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, required=True, help="an existing KB (kb ingest --all, or retrieval_latency.py's)")
    ap.add_argument("--db-url", default="", help="with --chroma-url: the KB on PostgreSQL + a Chroma server")
    ap.add_argument("--chroma-url", default="")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every shell run (root; "
                    "the service's own requests stay warm)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/query_latency.json")
    args = ap.parse_args()
    global COLD
    COLD = args.cold
    if bool(args.db_url) != bool(args.chroma_url):
        raise SystemExit("give both --db-url and --chroma-url, or neither")
    res: dict[str, object] = {"date": date.today().isoformat(), "cpus": os.cpu_count(),
                              "load_avg_1m_start": round(os.getloadavg()[0], 2),
                              "store": "postgresql + chroma server" if args.db_url else "embedded (sqlite + chroma dir)",
                              "page_cache": "dropped before each shell run" if args.cold else "warm",
                              "command": " ".join(["bench/query_latency.py", *sys.argv[1:]])}
    res.update(shell_times(args))
    service_times(args, res)
    res["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    for d in Path(tempfile.gettempdir()).glob("kb-trace-cache-*"):
        shutil.rmtree(d, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
