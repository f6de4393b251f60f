"""Store benchmark (not a test): upsert throughput and vector-query latency.

    .venv/bin/python bench/store_bench.py [--n 10000] [--queries 200] [--home DIR]

Writes N synthetic kernels (real embedding model, embedded Chroma, SQLite in a
fresh KB under /tmp), re-writes them (idempotent path, no re-embedding), then runs
vector queries with and without metadata filters. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kb.embed import get_embedder
from kb.features import Features
from kb.settings import load_settings
from kb.store import Kernel, KernelBundle, open_kb

MASKS = ("causal", "sliding_window", "none", "document", "prefix_lm", "block_sparse")
SCORES = ("none", "alibi", "softcap", "relative_bias")
ARCHS = ("sm80", "sm90", "sm100")


def synthetic_kernel(i: int) -> Kernel:
    feats = Features(mask=MASKS[i % 6], score_mod=SCORES[(i // 6) % 4], head_dim=(64, 96, 128, 256)[i % 4],
                     gqa_ratio=(1, 2, 4, 8)[(i // 24) % 4], arch=ARCHS[i % 3])
    ir = (
        f"program attn_{i}(q: [B, H, M, {feats.head_dim}] bf16, k: [B, H, N, {feats.head_dim}] bf16)\n"
        f"  schedule BLOCK_M={64 * (1 + i % 2)} BLOCK_N={32 * (1 + i % 4)} warps={4 * (1 + i % 2)} stages={2 + i % 3}\n"
        f"  for kv in blocks(0, N, BLOCK_N):\n    s = dot(q, k[kv]) * scale\n"
        f"    s = score_mod_{feats.score_mod}(s)\n    s = mask_{feats.mask}(s)\n    online_softmax(s, acc)\n"
    )
    return Kernel(name=f"attn_{i}", family=("fa2", "fa3", "flex", "cutlass")[i % 4], ir_text=ir,
                  features_json=feats.to_json(), arch=feats.arch, dtype="bf16", head_dim=feats.head_dim)


class TimedEmbedder:
    def __init__(self, inner) -> None:
        self.inner, self.name, self.seconds, self.texts = inner, inner.name, 0.0, 0

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        t = time.perf_counter()
        out = self.inner.embed(texts)
        self.seconds += time.perf_counter() - t
        self.texts += len(texts)
        return out


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--home", type=Path, default=None)
    args = ap.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="kb-bench-", dir="/tmp"))
    settings = load_settings(home=home)
    emb = TimedEmbedder(get_embedder(settings))
    emb.embed(["warm up"])  # model load is not part of the throughput
    emb.seconds = emb.texts = 0
    res: dict[str, object] = {"n": args.n, "home": str(home)}
    with open_kb(settings, embedder=emb) as kb:
        kernels = [synthetic_kernel(i) for i in range(args.n)]
        t = time.perf_counter()
        kb.write_kernels(KernelBundle(k) for k in kernels)
        total = time.perf_counter() - t
        res.update(upsert_s=round(total, 2), upsert_per_s=round(args.n / total, 1),
                   embed_s=round(emb.seconds, 2), store_s=round(total - emb.seconds, 2),
                   store_only_per_s=round(args.n / (total - emb.seconds), 1))
        t = time.perf_counter()
        kb.write_kernels(KernelBundle(synthetic_kernel(i)) for i in range(args.n))
        again = time.perf_counter() - t
        res.update(rewrite_idempotent_per_s=round(args.n / again, 1), rows=kb.counts().rows["kernels"],
                   vectors=kb.counts().vectors["kernels"])
        for label, where in (("query", None), ("query_filtered", {"arch": "sm90", "head_dim": 128})):
            lat = []
            for i in range(args.queries):
                text = f"{MASKS[i % 6]} mask with {SCORES[i % 4]} head dim {(64, 128)[i % 2]}"
                t = time.perf_counter()
                hits = kb.vector_query("kernels", text, k=10, where=where)
                lat.append((time.perf_counter() - t) * 1000)
                assert hits, "query returned nothing"
            res[f"{label}_p50_ms"] = round(statistics.median(lat), 2)
            res[f"{label}_p95_ms"] = round(pct(lat, 95), 2)
        vec = emb.inner.embed(["causal mask softcap"])[0]
        lat = []
        for _ in range(args.queries):
            t = time.perf_counter()
            kb.vectors.query("kernels", vec, 10)
            lat.append((time.perf_counter() - t) * 1000)
        res.update(chroma_only_p50_ms=round(statistics.median(lat), 2), chroma_only_p95_ms=round(pct(lat, 95), 2))
        res["doctor_ok"] = kb.doctor().ok
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
