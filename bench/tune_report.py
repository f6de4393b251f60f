"""Tables from `kb tune` results: the candidate as emitted against the best design, FlexAttention and SDPA,
and how many timed candidates each design order needed to get within 2% of the best (memory on vs off).

    python -m bench.tune_report RESULTS.json [--plan PLAN.json] [--markdown]

The orders come from the plan (`order_memory`, `order_no_memory`, written by `kb tune --plan`); every
design of both orders was timed in the same run, so each order is replayed over the same measurements.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from generate.tune_schema import impl_ms

WITHIN = 1.02  # "reached the best": within 2% of the fastest correct design


def candidates_to_best(order: list[str], times: dict[str, float]) -> int | None:
    """How many designs of `order` are timed until one is within 2% of the best of `times` (None: never)."""
    if not times:
        return None
    best = min(times.values())
    for n, d in enumerate(order, 1):
        if d in times and times[d] <= best * WITHIN:
            return n
    return None


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def rows(doc: dict, plan: dict | None) -> list[dict]:
    orders = {e["name"]: e for e in (plan or {}).get("entries", [])}
    out = []
    for e in doc["entries"]:
        for s in e.get("shapes", []):
            recs = s.get("records", [])
            times = {r["design"]: r["ms"] for r in recs if r["impl"].startswith("design ") and r.get("status") == "ok"}
            best = min(times.items(), key=lambda kv: kv[1]) if times else (None, None)
            emitted, table = impl_ms(s, "emitted"), impl_ms(s, "emitted+table")
            flex, sdpa = impl_ms(s, "flex"), impl_ms(s, "sdpa")
            flex_err = next((r.get("max_abs_err") for r in recs if r["impl"] == "flex"), None)
            p = orders.get(e["name"], {})
            out.append({"name": e["name"], "shape": s.get("shape", {}), "emitted_design": s.get("emitted_design"),
                        "emitted": emitted, "emitted_table": table, "best_design": best[0], "best": best[1],
                        "flex": flex, "flex_err": flex_err, "sdpa": sdpa,
                        "tflops_emitted": s.get("shape", {}).get("flops", 0) / emitted / 1e9 if emitted else None,
                        "wrong": [r["impl"] for r in recs if r.get("status") == "wrong"],
                        "on": candidates_to_best(p.get("order_memory", []), times) if p else None,
                        "off": candidates_to_best(p.get("order_no_memory", []), times) if p else None,
                        "error": e.get("error")})
    return out


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _bandwidth(shape: dict, ms: float | None, env: dict) -> str:
    """K and V bytes over the time, for decode shapes (a few queries per row: reading K and V is the work)."""
    if not ms or not shape.get("kv_bytes") or shape.get("M", 0) > 16:
        return "-"
    gbps = shape["kv_bytes"] / ms / 1e6
    copy = env.get("copy_gbps")
    return f"{gbps:.0f}" + (f" ({gbps / copy:.0%})" if copy else "")


def table(rs: list[dict], env: dict) -> str:
    head = ("spec", "shape", "emitted ms (design)", "best ms (design)", "best/emitted", "TFLOP/s", "x flex", "x sdpa",
            "mem on", "mem off", "K+V GB/s (of copy)")
    lines = [f"GPU {env.get('gpu')} ({env.get('arch')}), driver {env.get('driver')}, torch {env.get('torch_version')}, "
             f"triton {env.get('triton_version')}, {env.get('date')}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rs:
        if r["error"]:
            lines.append(f"| {r['name']} | error: {r['error'][:80]} |")
            continue
        d = r["shape"]
        em = r["emitted"]  # ModelNew as a user calls it (its block table cached by the module itself)
        lines.append("| " + " | ".join([
            r["name"], f"B{d.get('B')} H{d.get('Hq')}/{d.get('Hkv')} {d.get('M')}x{d.get('N')} D{d.get('D')}",
            f"{_f(em)} ({r['emitted_design']})", f"{_f(r['best'])} ({r['best_design']})",
            _f(r["best"] / em if r["best"] and em else None, ".2f"), _f(r["tflops_emitted"], ".0f"),
            _f(r["flex"] / em if r["flex"] and em else None, ".2f"), _f(r["sdpa"] / em if r["sdpa"] and em else None, ".2f"),
            _f(r["on"], "d") if r["on"] else "-", _f(r["off"], "d") if r["off"] else "-", _bandwidth(d, em, env)]) + " |")
    ok = [r for r in rs if not r["error"]]
    em = [r["emitted"] for r in ok]
    lines += ["", f"geomean best/emitted {geomean([r['best'] / e for r, e in zip(ok, em) if r['best'] and e]):.3f}; "
              f"x flex {geomean([r['flex'] / e for r, e in zip(ok, em) if r['flex'] and e]):.2f}; "
              f"x sdpa {geomean([r['sdpa'] / e for r, e in zip(ok, em) if r['sdpa'] and e]):.2f} "
              f"(over {sum(1 for r in ok if r['sdpa'])} specs where SDPA applies)"]
    swept = [r for r in ok if r["best"] is not None and (r["on"] or r["off"])]
    for key, label in (("on", "memory on"), ("off", "memory off")):
        reached = [r[key] for r in swept if r[key]]
        if swept:
            lines.append(f"{label}: within 2% of the best in {len(reached)}/{len(swept)} specs"
                         + (f", after {sum(reached) / len(reached):.1f} timed candidates on average" if reached else "")
                         + (f"; never within its timed candidates for {', '.join(r['name'] for r in swept if not r[key])}"
                            if len(reached) < len(swept) else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tune_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--plan", type=Path)
    a = ap.parse_args(argv)
    doc = json.loads(a.results.read_text())
    plan = json.loads(a.plan.read_text()) if a.plan else None
    print(table(rows(doc, plan), doc["env"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
