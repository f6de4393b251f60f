"""Retrieval evaluation (not a test): recall@1, recall@3, MRR and snippet-kind recall.

    .venv/bin/python bench/eval_retrieval.py --home /tmp/kb-eval [--specs tests/data/specs] [--out bench/results/retrieval.json]

For every labelled spec (`LABEL = {"family", "snippets", "features"}` in tests/data/specs/*.py)
the spec is traced, and `retrieve.hybrid.query` ranks the KB's executable programs (memory off)
in each mode: embedding-only, structural-only and hybrid. A hit is a ranked kernel whose label
family (`retrieve.families.label_family`) equals the spec's LABEL family. Snippet-kind recall is
the fraction of the LABEL's snippet kinds present among the returned snippets. The KB is the
one `kb ingest --all` builds; nothing here writes to it.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from generate.spec import load_spec
from kb.features import Features
from kb.ir.expr import print_expr
from kb.settings import load_settings
from kb.store import open_kb
from kb.store.kb import KnowledgeBase
from retrieve.families import label_family
from retrieve.hybrid import Filters, Mode, QueryResult, describe_target, query
from retrieve.structural import load_weights

__all__ = ["LabelledSpec", "ModeScores", "load_labelled", "first_hit_rank", "evaluate", "reachable_families",
           "decode_families", "program_labels"]

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
MODES: tuple[Mode, ...] = ("embedding", "structural", "hybrid")
EVAL_FILTERS = Filters(programs_only=True, memory=False)
RANK_ALL = 10_000  # ask for every candidate so the rank of the first hit is exact


@dataclass(frozen=True)
class LabelledSpec:
    name: str
    path: Path
    family: str  # LABEL["family"]
    snippets: tuple[str, ...]  # LABEL["snippets"]
    target: Features  # what tracing found (not the LABEL's copy)
    text: str  # the query text `kb query` would embed


@dataclass(frozen=True)
class SpecOutcome:
    spec: str
    family: str
    rank: int | None  # 1-based rank of the first kernel of the right family; None = none ranked
    top: str  # label family of the top-ranked kernel
    snippet_recall: float


@dataclass(frozen=True)
class ModeScores:
    mode: str
    n: int
    recall_at_1: float
    recall_at_3: float
    mrr: float
    snippet_recall: float
    outcomes: tuple[SpecOutcome, ...]


def _label_of(path: Path) -> dict:
    """The module-level LABEL literal, read without importing the file a second time."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "LABEL" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{path}: no module-level LABEL")


def load_labelled(spec_dir: Path) -> list[LabelledSpec]:
    """Trace every labelled spec in `spec_dir` (sorted by file name)."""
    out = []
    for path in sorted(spec_dir.glob("*.py")):
        label = _label_of(path)
        spec = load_spec(path)
        text = describe_target(spec.features, print_expr(spec.score_mod) if spec.score_mod is not None else None,
                               print_expr(spec.mask_mod) if spec.mask_mod is not None else None)
        out.append(LabelledSpec(path.stem, path, label["family"], tuple(label["snippets"]), spec.features, text))
    return out


def first_hit_rank(result: QueryResult, family: str) -> int | None:
    for i, r in enumerate(result.kernels, 1):
        if label_family(r.family, r.features) == family:
            return i
    return None


def snippet_recall(result: QueryResult, wanted: tuple[str, ...]) -> float:
    if not wanted:
        return 1.0
    have = {s.kind for s in result.snippets}
    return sum(k in have for k in wanted) / len(wanted)


def program_labels(specs: list[LabelledSpec], reachable: dict[str, int],
                   decode_reachable: set[str] | None = None) -> dict[str, str]:
    """Spec name -> the label family of the *program* a transfer starts from.

    The LABEL family when the KB holds an executable program of it (for a decode spec: a decode /
    split-KV program of it, when `decode_reachable` lists those families). Otherwise (FA4 CuTe DSL
    and CUTLASS lift into snippets only, so `cute_fa4` and `cutlass_fmha` have no program to
    retrieve; the serving sources give packed varlen prefill but no paged decode program yet)
    the docs/specs.md rule without its FA4/CUTLASS branches: decode -> triton_decode, else
    triton_fwd; the FA4/CUTLASS regions still come in as snippets.
    """
    out = {}
    for sp in specs:
        decode = sp.target.decode or sp.target.split_kv
        fallback = "triton_decode" if decode else "triton_fwd"
        ok = reachable.get(sp.family) and (decode_reachable is None or not decode or sp.family in decode_reachable)
        out[sp.name] = sp.family if ok else fallback
    return out


def evaluate(kb: KnowledgeBase, specs: list[LabelledSpec], modes: tuple[Mode, ...] = MODES,
             weights: dict[str, float] | None = None, labels: dict[str, str] | None = None) -> list[ModeScores]:
    """Score each mode over `specs`; recall@k counts a spec when a right-family kernel ranks <= k.

    `labels` overrides the LABEL family per spec name (see `program_labels`).
    """
    scores = []
    for mode in modes:
        outcomes = []
        for sp in specs:
            family = (labels or {}).get(sp.name, sp.family)
            res = query(kb, sp.text, sp.target, k=RANK_ALL, filters=EVAL_FILTERS, mode=mode, weights=weights)
            top = label_family(res.kernels[0].family, res.kernels[0].features) if res.kernels else ""
            outcomes.append(SpecOutcome(sp.name, family, first_hit_rank(res, family), top,
                                        snippet_recall(res, sp.snippets)))
        n = len(outcomes)
        scores.append(ModeScores(
            mode, n,
            recall_at_1=sum(o.rank is not None and o.rank <= 1 for o in outcomes) / n,
            recall_at_3=sum(o.rank is not None and o.rank <= 3 for o in outcomes) / n,
            mrr=sum(1.0 / o.rank for o in outcomes if o.rank) / n,
            snippet_recall=sum(o.snippet_recall for o in outcomes) / n,
            outcomes=tuple(outcomes),
        ))
    return scores


def decode_families(kb: KnowledgeBase) -> set[str]:
    """Label families with an executable decode / split-KV program in the KB (memory off)."""
    res = query(kb, "attention", None, k=RANK_ALL, filters=EVAL_FILTERS, mode="embedding")
    return {label_family(r.family, r.features) for r in res.kernels if r.features.decode or r.features.split_kv}


def reachable_families(kb: KnowledgeBase) -> dict[str, int]:
    """Label family -> number of executable programs in the KB (memory off)."""
    res = query(kb, "attention", None, k=RANK_ALL, filters=EVAL_FILTERS, mode="embedding")
    counts: dict[str, int] = {}
    for r in res.kernels:
        fam = label_family(r.family, r.features)
        counts[fam] = counts.get(fam, 0) + 1
    return dict(sorted(counts.items()))


def _print_table(title: str, scores: list[ModeScores]) -> None:
    print(title)
    print(f"  {'mode':<11} {'n':>3} {'R@1':>6} {'R@3':>6} {'MRR':>6} {'snip':>6}")
    for s in scores:
        print(f"  {s.mode:<11} {s.n:>3} {s.recall_at_1:6.3f} {s.recall_at_3:6.3f} {s.mrr:6.3f} {s.snippet_recall:6.3f}")
    for s in scores:
        misses = [f"{o.spec} ({o.family}: rank {o.rank}, top {o.top})" for o in s.outcomes if not o.rank or o.rank > 3]
        if misses:
            print(f"  {s.mode} misses@3: " + "; ".join(misses))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--home", type=Path, required=True, help="KB built by `kb ingest --all`")
    ap.add_argument("--specs", type=Path, default=ROOT / "tests/data/specs")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/retrieval.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    specs = load_labelled(args.specs)
    with open_kb(load_settings(home=args.home), create=False) as kb:
        reach = reachable_families(kb)
        labels = program_labels(specs, reach, decode_families(kb))
        strict = evaluate(kb, specs)
        scores = evaluate(kb, specs, labels=labels)
        counts = kb.counts().rows
    print("programs per label family:", reach)
    relabelled = {sp.name: f"{sp.family}->{labels[sp.name]}" for sp in specs if labels[sp.name] != sp.family}
    print(f"LABEL families without an executable program, relabelled ({len(relabelled)}):", relabelled)
    _print_table("strict (LABEL family as written)", strict)
    _print_table("program labels (unreachable LABEL families mapped, see program_labels)", scores)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "kb": str(args.home), "kb_rows": dict(counts), "specs": len(specs),
        "programs_per_label_family": reach, "filters": asdict(EVAL_FILTERS),
        "weights": load_weights(), "relabelled": relabelled,
        "modes": [asdict(s) for s in scores], "strict_modes": [asdict(s) for s in strict], "seconds": round(time.perf_counter() - t0, 1),
    }, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
