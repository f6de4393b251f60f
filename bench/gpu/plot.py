"""One PNG per variant from a bench JSON: TFLOP/s of every timed implementation per case (matplotlib, Agg)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot_all"]


def plot_all(json_path: Path, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(json_path).read_text())
    recs = [r for r in doc["records"] if r["status"] == "ok" and r["tflops"]]
    written = []
    for variant in sorted({r["variant"] for r in recs}):
        rs = [r for r in recs if r["variant"] == variant and not r["impl"].startswith(("generated[", "generated-"))]
        cases = list(dict.fromkeys(r["case"] for r in rs))
        impls = list(dict.fromkeys(r["impl"] for r in rs))
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases) + 2), 4))
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            ys = [next((r["tflops"] for r in rs if r["case"] == c and r["impl"] == impl), 0.0) for c in cases]
            ax.bar([x + i * width for x in range(len(cases))], ys, width, label=impl)
        ax.axhline(doc["peak_bf16_tflops"], color="k", ls="--", lw=0.8, label="bf16 matmul peak")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))])
        ax.set_xticklabels([c.split(" ", 1)[1] for c in cases], fontsize=7)
        ax.set_ylabel("TFLOP/s (unmasked work)")
        ax.set_title(f"{variant}: bf16 forward on {doc['env']['gpu']}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = Path(out_dir) / f"bench_{variant}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
