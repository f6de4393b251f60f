"""Query latency with ~10k kernels (not a test): p50/p95 of `retrieve.hybrid.query`, end to end.

    .venv/bin/python bench/retrieval_latency.py --base /tmp/kb-eval [--n 10000] [--queries 100] [--home DIR]
        [--db-url postgresql://... --chroma-url http://127.0.0.1:PORT]

Copies the ingested KB at `--base` (real programs, snippets, tunables) to a fresh home, adds
`--n` synthetic executable kernels with varied features through `KnowledgeBase.write_kernels`
(real embeddings), then times `query(...)` for the labelled specs' query texts and features
after a warm-up: embedding, candidate read, ranking, snippets and lessons included. Prints
one JSON object and writes bench/results/retrieval_latency.json. With --db-url and --chroma-url the KB
is a team KB on PostgreSQL and a Chroma server (empty at start): the base KB is copied in through
`kb export` / `kb import` (its rows re-embedded by the real model), then filled as above.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `kb` CLI sets it (cli/app.py), before torch loads

import numpy as np
import torch

from bench.eval_retrieval import ROOT, load_labelled
from kb.embed import get_embedder
from kb.features import Features
from kb.settings import load_settings
from kb.store import Kernel, KernelBundle, open_kb
from retrieve.hybrid import Filters, query

MASKS = ("none", "causal", "sliding_window", "document", "prefix_lm", "block_sparse", "custom")
SCORES = ("none", "alibi", "softcap", "relative_bias", "bias_table", "custom")
ARCHS = ("any", "sm80", "sm90", "sm100")
DTYPES = ("bf16", "fp16", "fp32")


def synthetic_kernel(i: int) -> Kernel:
    """An executable-looking kernel row; features vary over every ranked term."""
    split = i % 5 == 0
    f = Features(mask=MASKS[i % 7], causal=MASKS[i % 7] == "causal", sliding_window=MASKS[i % 7] == "sliding_window",
                 score_mod=SCORES[(i // 7) % 6], gqa_ratio=(1, 2, 4, 8)[(i // 42) % 4], head_dim=(64, 96, 128, 256)[i % 4],
                 dtype=DTYPES[(i // 3) % 3], split_kv=split, decode=split, return_lse=i % 2 == 0, arch=ARCHS[(i // 11) % 4])
    ir = (f"program synth_{i}(q: [B, Hq, M, {f.head_dim}] {f.dtype}, k: [B, Hkv, N, {f.head_dim}] {f.dtype})\n"
          f"  schedule BLOCK_M={64 * (1 + i % 2)} BLOCK_N={32 * (1 + i % 4)} warps={4 * (1 + i % 2)}\n"
          f"  for n_start in range(0, N, BLOCK_N): score_mod {f.score_mod}; mask {f.mask}; online_softmax\n")
    return Kernel(name=f"synth_{i}", family=("fa2_triton", "fa2_cuda", "fa4_cute", "generated")[i % 4],
                  origin="generated" if i % 4 == 3 else "ingest", ir_text=ir, features_json=f.to_json(),
                  arch=f.arch, dtype=f.dtype, head_dim=f.head_dim, verified=i % 3 != 0)


class HashEmbedder:
    """Deterministic unit vectors from a text hash, under the real model's name and dimension.

    Only for filling the KB with synthetic rows: on a shared 2-core machine the real model
    embeds ~10 texts/s, and the index size, not the vectors' meaning, sets query latency.
    Queries themselves always use the real model.
    """

    def __init__(self, real) -> None:
        self.name, self.dim = real.name, len(real.embed(["dimension probe"])[0])

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        out = []
        for t in texts:
            v = np.random.default_rng(int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little")).standard_normal(self.dim)
            out.append((v / np.linalg.norm(v)).tolist())
        return out


class TimedEmbedder:
    """The real model, with the time spent in it summed (to split query latency)."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.seconds = inner, inner.name, 0.0

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        t = time.perf_counter()
        out = self.inner.embed(texts)
        self.seconds += time.perf_counter() - t
        return out


def _pct(xs: Sequence[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1]


def time_queries(kb, specs, n: int, filters: Filters) -> dict[str, float]:
    for sp in specs[:5]:
        query(kb, sp.text, sp.target, filters=filters)  # warm-up: model, caches, SQLite pages
    ms, rest = [], []
    for i in range(n):
        sp = specs[i % len(specs)]
        e0 = kb.embedder.seconds
        t = time.perf_counter()
        query(kb, sp.text, sp.target, filters=filters)
        ms.append((time.perf_counter() - t) * 1000)
        rest.append(ms[-1] - (kb.embedder.seconds - e0) * 1000)
    return {"p50_ms": round(_pct(ms, 50), 1), "p95_ms": round(_pct(ms, 95), 1), "mean_ms": round(statistics.mean(ms), 1),
            "without_model_p50_ms": round(_pct(rest, 50), 1), "without_model_p95_ms": round(_pct(rest, 95), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="KB built by `kb ingest --all` (copied, not changed)")
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--home", type=Path, default=None, help="reuse a KB this script filled before")
    ap.add_argument("--fill-embedding", choices=("hash", "model"), default="hash",
                    help="vectors of the synthetic rows: hash (fast, see HashEmbedder) or the real model")
    ap.add_argument("--db-url", default=None, help="with --chroma-url: fill and time a KB on PostgreSQL + a Chroma server")
    ap.add_argument("--chroma-url", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/retrieval_latency.json")
    args = ap.parse_args()
    res: dict[str, object] = {"n_synthetic": args.n, "store": "postgresql + chroma server" if args.db_url else "embedded"}
    home = args.home
    if home is None:
        home = Path(tempfile.mkdtemp(prefix="kb-latency-", dir="/tmp")) / "kb"
        if args.db_url:
            dump = home.parent / "base.jsonl"
            with open_kb(load_settings(home=args.base)) as base:
                base.export_jsonl(dump)
            with open_kb(load_settings(home=home, db_url=args.db_url, chroma_url=args.chroma_url), create=True) as team:
                team.import_jsonl(dump)
        else:
            shutil.copytree(args.base, home, ignore=shutil.ignore_patterns(".kb.lock"))
    settings = load_settings(home=home, db_url=args.db_url, chroma_url=args.chroma_url)
    specs = load_labelled(ROOT / "tests/data/specs")
    real = get_embedder(settings)
    if args.home is None:
        filler = HashEmbedder(real) if args.fill_embedding == "hash" else real
        with open_kb(settings, embedder=filler) as kb:
            t = time.perf_counter()
            kb.write_kernels(KernelBundle(synthetic_kernel(i)) for i in range(args.n))
            res["fill_s"], res["fill_embedding"] = round(time.perf_counter() - t, 1), args.fill_embedding
    with open_kb(settings, embedder=TimedEmbedder(real)) as kb:
        res["kernels"] = kb.counts().rows["kernels"]
        kb.embedder.embed(["warm up"])  # model load is not query latency
        # the end-of-run load average counts this run's own threads; the start shows other jobs
        res["load_avg_1m_start"], res["torch_threads"] = round(os.getloadavg()[0], 2), torch.get_num_threads()
        t = time.perf_counter()
        kb.embedder.embed([specs[0].text])
        res["embed_one_ms"] = round((time.perf_counter() - t) * 1000, 1)
        res["hybrid_memory_on"] = time_queries(kb, specs, args.queries, Filters())
        res["hybrid_memory_off"] = time_queries(kb, specs, args.queries, Filters(memory=False))
    res["home"], res["load_avg_1m"] = str(home), round(os.getloadavg()[0], 2)
    res["cpus"] = os.cpu_count()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
