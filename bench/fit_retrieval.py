"""Fit the retrieval weight table (not a test): L2 logistic regression on (spec, kernel) pairs.

    .venv/bin/python bench/fit_retrieval.py --home /tmp/kb-eval [--write]

Every labelled spec is paired with every executable program in the KB (memory off); a pair
is relevant iff the kernel's label family equals the spec's program label
(`bench.eval_retrieval.program_labels`). A pair's feature vector is the raw value of each
ranking term: the structural indicators (`retrieve.structural.TERMS`), the embedding
similarity and the relative perf, read through `retrieve.hybrid.query` with unit weights so
the fit sees exactly what ranking sees. Leave-one-spec-out cross-validation ranks each
held-out spec's candidates with weights fitted on the others and reports recall@1/3 and MRR.
With `--write` the weights fitted on all specs go to `retrieve/weights.json` together with
the fit date, data size and CV scores. A term that never varies in the data (e.g. perf with
no measured records) cannot be fitted and keeps its default weight; the file says which.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.eval_retrieval import (EVAL_FILTERS, RANK_ALL, ROOT, decode_families, load_labelled, program_labels,
                                  reachable_families)
from kb.settings import load_settings
from kb.store import open_kb
from kb.store.kb import KnowledgeBase
from retrieve.families import label_family
from retrieve.hybrid import query
from retrieve.structural import DEFAULT_WEIGHTS, HYBRID_TERMS, TERMS, WEIGHTS_PATH

__all__ = ["PairData", "pair_data", "fit_logistic", "signs", "loso_cv"]

log = logging.getLogger(__name__)

COLUMNS: tuple[str, ...] = (*TERMS, *HYBRID_TERMS)
LAMBDAS = (0.01, 0.1, 1.0, 10.0)


@dataclass(frozen=True)
class PairData:
    x: np.ndarray  # [pairs, len(COLUMNS)] raw term values
    y: np.ndarray  # [pairs] 1.0 = relevant
    group: np.ndarray  # [pairs] spec index
    specs: tuple[str, ...]


def pair_data(kb: KnowledgeBase, specs, labels: dict[str, str]) -> PairData:
    unit = {c: 1.0 for c in COLUMNS}
    rows, ys, groups = [], [], []
    for gi, sp in enumerate(specs):
        # hybrid mode with unit weights: each term's contribution is its raw value
        res = query(kb, sp.text, sp.target, k=RANK_ALL, filters=EVAL_FILTERS, mode="hybrid", weights=unit)
        for r in res.kernels:
            rows.append([r.terms.get(c, 0.0) for c in COLUMNS])
            ys.append(float(label_family(r.family, r.features) == labels[sp.name]))
            groups.append(gi)
    return PairData(np.array(rows), np.array(ys), np.array(groups), tuple(sp.name for sp in specs))


# Sign constraints (a monotone ranker): a match never counts against a candidate, a mismatch
# never for it. 35 specs whose labels follow the source family more than the features cannot
# pin down these signs; unconstrained, the fit turns several match terms negative.
PENALTIES = frozenset({"mask_none_vs_some", "score_missing"})
FREE = frozenset({"bias"})


def signs(columns: tuple[str, ...]) -> np.ndarray:
    """+1: weight >= 0, -1: weight <= 0, 0: free."""
    return np.array([0 if c in FREE else -1 if c in PENALTIES else 1 for c in columns], dtype=float)


def fit_logistic(x: np.ndarray, y: np.ndarray, lam: float, sign: np.ndarray, iters: int = 3000) -> np.ndarray:
    """Projected gradient descent on mean log-loss + lam/2 |w|^2 with the sign constraints of `sign`.

    The objective is convex and the constraint set a box, so projection after each step
    (step 1/L, L the gradient's Lipschitz bound) converges to the constrained optimum.
    """
    n = len(y)
    lip = np.linalg.norm(x, 2) ** 2 / (4 * n) + lam
    w = np.zeros(x.shape[1])
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        w_new = w - (x.T @ (p - y) / n + lam * w) / lip
        w_new = np.where(sign > 0, np.maximum(w_new, 0.0), np.where(sign < 0, np.minimum(w_new, 0.0), w_new))
        if np.abs(w_new - w).max() < 1e-10:
            return w_new
        w = w_new
    return w


def _rank_scores(scores: np.ndarray, y: np.ndarray) -> int | None:
    """1-based rank of the first relevant item under `scores` (ties broken pessimistically)."""
    if not y.any():
        return None
    best = scores[y > 0].max()
    return int((scores[y == 0] >= best).sum()) + 1


def _metrics(ranks: list[int | None]) -> dict[str, float]:
    n = len(ranks)
    return {"recall_at_1": sum(r == 1 for r in ranks) / n, "recall_at_3": sum(r is not None and r <= 3 for r in ranks) / n,
            "mrr": sum(1.0 / r for r in ranks if r) / n}


def loso_cv(d: PairData, lam: float, cols: np.ndarray) -> dict[str, float]:
    """Leave-one-spec-out: fit on the other specs, rank the held-out spec's candidates."""
    ranks = []
    for g in range(len(d.specs)):
        train, test = d.group != g, d.group == g
        w = fit_logistic(d.x[train][:, cols], d.y[train], lam, signs(tuple(COLUMNS[c] for c in cols)))
        ranks.append(_rank_scores(d.x[test][:, cols] @ w, d.y[test]))
    return _metrics(ranks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--specs", type=Path, default=ROOT / "tests/data/specs")
    ap.add_argument("--write", action="store_true", help=f"write {WEIGHTS_PATH}")
    ap.add_argument("--cache", type=Path, default=None, help="npz of the pair data: reused if present, else written")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.cache and args.cache.is_file():
        z = np.load(args.cache)
        d = PairData(z["x"], z["y"], z["group"], tuple(z["specs"]))
    else:
        specs = load_labelled(args.specs)
        with open_kb(load_settings(home=args.home), create=False) as kb:
            labels = program_labels(specs, reachable_families(kb), decode_families(kb))
            d = pair_data(kb, specs, labels)
        if args.cache:
            np.savez(args.cache, x=d.x, y=d.y, group=d.group, specs=np.array(d.specs))
    varies = d.x.std(axis=0) > 0
    varies[COLUMNS.index("bias")] = True
    cols = np.flatnonzero(varies)
    fixed = [c for c, v in zip(COLUMNS, varies) if not v]
    print(f"{len(d.specs)} specs, {len(d.y)} pairs, {int(d.y.sum())} relevant; constant terms kept at default: {fixed}")
    cv = {str(lam): loso_cv(d, lam, cols) for lam in LAMBDAS}
    for lam, m in cv.items():
        print(f"  lambda {lam:>5}: LOSO R@1 {m['recall_at_1']:.3f}  R@3 {m['recall_at_3']:.3f}  MRR {m['mrr']:.3f}")
    best = max(LAMBDAS, key=lambda lam: (cv[str(lam)]["mrr"], cv[str(lam)]["recall_at_3"], lam))
    w = fit_logistic(d.x[:, cols], d.y, best, signs(tuple(COLUMNS[c] for c in cols)))
    fitted = dict(DEFAULT_WEIGHTS)
    fitted.update({c: 0.0 for c in COLUMNS if c not in fixed})
    fitted.update({COLUMNS[c]: round(float(v), 4) for c, v in zip(cols, w)})
    # the hand-set defaults are a candidate too: nothing is fitted, so every spec is held out
    dw = np.array([DEFAULT_WEIGHTS[c] for c in COLUMNS])
    cv_default = _metrics([_rank_scores(d.x[d.group == g] @ dw, d.y[d.group == g]) for g in range(len(d.specs))])
    print(f"  defaults    : R@1 {cv_default['recall_at_1']:.3f}  R@3 {cv_default['recall_at_3']:.3f}  MRR {cv_default['mrr']:.3f}")
    use_fit = (cv[str(best)]["mrr"], cv[str(best)]["recall_at_3"]) > (cv_default["mrr"], cv_default["recall_at_3"])
    weights = fitted if use_fit else dict(DEFAULT_WEIGHTS)
    print(f"chosen: {'fitted, lambda ' + str(best) if use_fit else 'defaults (the fit does not beat them held out)'}; weights:")
    for c in COLUMNS:
        print(f"  {c:<18} {weights[c]:+8.4f}{'  (not fitted: constant in the data)' if c in fixed else ''}")
    if args.write:
        WEIGHTS_PATH.write_text(json.dumps({
            "fitted": time.strftime("%Y-%m-%d"), "method": "L2 logistic regression, sign-constrained (match terms >= 0, penalties <= 0), projected gradient, pointwise (spec, kernel) pairs",
            "kb": str(args.home), "specs": len(d.specs), "pairs": len(d.y), "relevant": int(d.y.sum()),
            "lambda": best, "not_fitted": fixed, "selected": "fitted" if use_fit else "defaults",
            "cv": {"scheme": "leave-one-spec-out, ties ranked pessimistically", "by_lambda": cv, "fit": cv[str(best)],
                   "defaults": cv_default},
            "fitted_weights": fitted, "weights": weights,
        }, indent=1) + "\n")
        print(f"wrote {WEIGHTS_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
