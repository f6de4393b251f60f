"""How well design ranking predicts: leave one spec out of the KB's measured sweeps, rank designs for it from the
rest, and read how fast the first design its own sweep timed ran relative to that sweep's best (1.0: the best).
Rows `shipped, fastest of first K`: the fastest of the first K ranked designs the sweep timed, which is what a module
gets that times its listed designs on the user's shape (`TIME_DESIGNS`, kb/lower/triton_preamble.py) when K designs
are listed.

`python -m bench.design_ranking [--json]` on the KB of the settings (`kb ingest --all` loads the shipped sweeps).
Rules compared: `generate.designs._ranked_by_sweeps` as shipped, and variants of its two choices (which sweeps are
near enough to decide; whether a sweep that did not time a design scores it 0 or says nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable, Sequence

from generate.designs import NEAR, NEAR_BACKWARD, TABLE_DEPTH, Sweep, _decode, _ranked_by_sweeps, perf_similarity, sweeps_from_kb
from kb.ir.design import Design
from kb.settings import load_settings
from kb.store import open_kb

Rule = Callable[[Sequence[tuple[Sweep, float]]], list[Design]]


def variant(near_frac: float, untimed_zero: bool) -> Rule:
    """The shipped rule with its two choices set otherwise (near_frac 0: every sweep in one tier)."""
    return functools.partial(_ranked_by_sweeps, near_frac=near_frac, untimed_zero=untimed_zero)


def leave_one_out(sweeps: Sequence[Sweep], rule: Rule, backward: bool, first: int = 1) -> list[float]:
    """Per sweep with 3+ designs: its relative speed at the first design `rule` ranks (among those it timed) from the
    other specs' sweeps, weighted as `rank_designs` weighs them; with `first` > 1, at the fastest of the first
    `first` of them."""
    out = []
    for t in sweeps:
        if t.features.backward != backward or len(t.times) < 3:
            continue
        near = [(s, math.exp(8.0 * (perf_similarity(t.features, s.features) - 1.0))) for s in sweeps
                if s.arch == t.arch and s.bucket == t.bucket and _decode(s.features) == _decode(t.features)
                and s.features.backward == backward
                and (not backward or s.features.learned_table == t.features.learned_table)
                and s.case[0] != t.case[0] and s.kernel_id != t.kernel_id]
        rel = t.relative()
        ranked = [d for d in rule(near) if d in rel] if near else []
        if ranked:
            out.append(max(rel[d] for d in ranked[:first]))
    return out


def _row(backward: bool, rule: str, v: Sequence[float]) -> dict:
    return {"kind": "backward" if backward else "forward", "rule": rule, "targets": len(v),
            "geomean": math.exp(sum(map(math.log, v)) / len(v)), "min": min(v), "within_2pct": sum(x >= 0.98 for x in v)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    sweeps = sweeps_from_kb(open_kb(load_settings()))
    variants = {f"near>={f} untimed={'0' if z else 'silent'}": variant(f, z) for f in (0.0, 0.25, 0.5, 0.8) for z in (True, False)}
    rows = []
    for backward in (False, True):
        shipped = variant(NEAR_BACKWARD if backward else NEAR, True)  # as generate.designs.rank_designs calls it
        for name, rule in {"shipped": shipped, **variants}.items():
            v = leave_one_out(sweeps, rule, backward)
            if v:
                rows.append(_row(backward, name, v))
        for k in range(2, TABLE_DEPTH + 1):
            rows.append(_row(backward, f"shipped, fastest of first {k}", leave_one_out(sweeps, shipped, backward, k)))
    if args.json:
        print(json.dumps(rows, indent=1))
    for r in rows:
        print(f"{r['kind']:8s} {r['rule']:30s} n={r['targets']:3d} geomean {r['geomean']:.3f} min {r['min']:.3f} "
              f"within 2%: {r['within_2pct']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
