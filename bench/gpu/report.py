"""Summaries of a bench JSON: speedups, geomeans and the printed table (pure functions over the JSON dict)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CaseSummary", "summarize", "geomean", "summary_table"]


@dataclass(frozen=True)
class CaseSummary:
    case: str
    variant: str
    ms: dict[str, float]  # impl -> median ms (timed implementations only)
    tflops: dict[str, float]
    frac_peak: float | None  # of the default generated kernel
    best_generated: str | None

    def speedup(self, other: str, impl: str = "generated") -> float | None:
        if impl not in self.ms or other not in self.ms:
            return None
        return self.ms[other] / self.ms[impl]


def summarize(doc: dict) -> list[CaseSummary]:
    by_case: dict[str, list[dict]] = {}
    for r in doc["records"]:
        by_case.setdefault(r["case"], []).append(r)
    out = []
    for case, recs in by_case.items():
        ok = [r for r in recs if r["status"] == "ok" and r["ms"] is not None]
        ms = {r["impl"]: r["ms"] for r in ok}
        tf = {r["impl"]: r["tflops"] for r in ok}
        gen = [r for r in ok if r["impl"].startswith("generated") and not r["impl"].startswith("generated-")]
        best = min(gen, key=lambda r: r["ms"])["impl"] if gen else None
        frac = next((r["frac_peak"] for r in ok if r["impl"] == "generated"), None)
        out.append(CaseSummary(case, recs[0]["variant"], ms, tf, frac, best))
    return out


def geomean(xs: Iterable[float | None]) -> float | None:
    """Of the positive values (a missing speed-up is None and left out); None where there are none."""
    pos = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in pos) / len(pos)) if pos else None


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def summary_table(doc: dict) -> str:
    rows = summarize(doc)
    cols = ["generated", "flex", "sdpa-cudnn", "sdpa-flash", "eager"]
    head = f"{'case':34} " + " ".join(f"{c:>10}" for c in cols) + f" {'%peak':>6} {'x flex':>7} {'x cudnn':>7} {'best gen':>22}"
    lines = [f"GPU {doc['env']['gpu']}  bf16 peak {doc['peak_bf16_tflops']:.0f} TFLOP/s  (TFLOP/s below; "
             "unmasked work only)", head]
    for s in rows:
        sdpa_masked = next((k for k in ("sdpa-cudnn", "sdpa-efficient") if k in s.tflops), None)
        vals = [s.tflops.get(c) if not (c == "sdpa-cudnn" and c not in s.tflops and sdpa_masked) else s.tflops[sdpa_masked]
                for c in cols]
        best = s.best_generated or "-"
        best_tf = s.tflops.get(best) if s.best_generated else None
        lines.append(f"{s.case:34} " + " ".join(f"{_f(v):>10}" for v in vals)
                     + f" {_f(None if s.frac_peak is None else 100 * s.frac_peak):>6}"
                     + f" {_f(s.speedup('flex'), '{:.2f}'):>7} {_f(s.speedup('sdpa-cudnn'), '{:.2f}'):>7}"
                     + f" {best[9:] or 'default'}:{_f(best_tf)}".rjust(23))
    g_flex = geomean([s.speedup("flex") for s in rows])
    g_best = geomean([s.speedup("flex", s.best_generated) for s in rows if s.best_generated])
    lines.append(f"geomean speedup vs flex: default schedule {_f(g_flex, '{:.2f}')}x, best schedule {_f(g_best, '{:.2f}')}x")
    return "\n".join(lines)
