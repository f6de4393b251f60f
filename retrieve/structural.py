"""Structural similarity: an additive model over feature matches (SparseDitto-style ranking).

`match_vector(target, candidate)` turns a (spec features, kernel features) pair into named
indicator terms; the score is the dot product with one visible weight table. Weights are
fitted on the labelled spec set by `bench/fit_retrieval.py` (logistic regression) and saved
to `retrieve/weights.json`; `DEFAULT_WEIGHTS` are only the fallback before any fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kb.features import Features

__all__ = ["TERMS", "HYBRID_TERMS", "match_vector", "StructuralScore", "structural_score", "load_weights", "WEIGHTS_PATH"]

WEIGHTS_PATH = Path(__file__).with_name("weights.json")

# Term name -> what it tests. Every term is 0/1 (or a small graded value in [0, 1]).
TERMS: dict[str, str] = {
    "mask_same": "same mask kind",
    "mask_none_vs_some": "one side masks, the other does not",
    "causal_same": "both causal or both not",
    "window_same": "both sliding-window or both not",
    "score_same": "same score_mod kind",
    "score_missing": "target has a score_mod the candidate lacks",
    "split_same": "both split-KV (decode) or both not",
    "decode_same": "both decode-shaped or both not",
    "gqa_target": "target is GQA/MQA and the candidate maps heads (ratio > 1 seen) ",
    "head_dim_same": "same head dim",
    "head_dim_close": "head dims within a factor of 2",
    "dtype_same": "same dtype",
    "arch_ok": "candidate arch is 'any' or equals the target arch",
    "lse_same": "both return LSE or both not",
    "verified": "candidate program was verified by the interpreter",
    "executable": "candidate is a complete program (not snippets only)",
    "bias": "constant",
}

# Hybrid terms beside the structural ones: embedding similarity and relative measured perf.
HYBRID_TERMS: dict[str, str] = {
    "embedding": "cosine similarity of the query text and the kernel's IR/feature text",
    "perf": "best measured TFLOP/s on the target arch relative to the best candidate",
}

DEFAULT_WEIGHTS: dict[str, float] = {
    "embedding": 1.0, "perf": 0.5,
    "mask_same": 2.0, "mask_none_vs_some": -1.0, "causal_same": 1.0, "window_same": 1.0,
    "score_same": 1.5, "score_missing": -0.5, "split_same": 2.0, "decode_same": 1.0,
    "gqa_target": 0.5, "head_dim_same": 0.5, "head_dim_close": 0.25, "dtype_same": 0.25,
    "arch_ok": 0.5, "lse_same": 0.1, "verified": 1.0, "executable": 1.0, "bias": 0.0,
}


def match_vector(target: Features, cand: Features, *, verified: bool, executable: bool) -> dict[str, float]:
    """Indicator terms for a (target, candidate) pair; keys are exactly TERMS."""
    # head_dim 0 = the program takes any head dim (HEAD_PAD decided at launch)
    hd_ratio = 1.0 if cand.head_dim == 0 else max(target.head_dim, cand.head_dim) / max(1, min(target.head_dim, cand.head_dim))
    return {
        "mask_same": float(target.mask == cand.mask),
        "mask_none_vs_some": float((target.mask == "none") != (cand.mask == "none")),
        "causal_same": float(target.causal == cand.causal),
        "window_same": float(target.sliding_window == cand.sliding_window),
        "score_same": float(target.score_mod == cand.score_mod),
        "score_missing": float(target.score_mod != "none" and cand.score_mod == "none"),
        "split_same": float(target.split_kv == cand.split_kv),
        "decode_same": float(target.decode == cand.decode),
        "gqa_target": float(target.gqa_ratio > 1 and cand.gqa_ratio > 1),
        "head_dim_same": float(target.head_dim == cand.head_dim),
        "head_dim_close": float(hd_ratio <= 2),
        "dtype_same": float(target.dtype == cand.dtype),
        "arch_ok": float(cand.arch in ("any", target.arch) or target.arch == "any"),
        "lse_same": float(target.return_lse == cand.return_lse),
        "verified": float(verified),
        "executable": float(executable),
        "bias": 1.0,
    }


@dataclass(frozen=True)
class StructuralScore:
    total: float
    terms: dict[str, float]  # term -> weight * value (the contribution), for explanations


def load_weights(path: Path = WEIGHTS_PATH) -> dict[str, float]:
    """Fitted weights if present, else the defaults; a structural term missing from the file is an error.

    The result always has every TERMS and HYBRID_TERMS key (hybrid terms the file lacks keep their default).
    """
    if not path.is_file():
        return dict(DEFAULT_WEIGHTS)
    data = json.loads(path.read_text())
    weights = data.get("weights", data)
    missing = set(TERMS) - set(weights)
    if missing:
        raise ValueError(f"{path}: weights missing terms {sorted(missing)}")
    out = {k: float(weights[k]) for k in TERMS}
    out.update({k: float(weights.get(k, DEFAULT_WEIGHTS[k])) for k in HYBRID_TERMS})
    return out


def structural_score(
    target: Features, cand: Features, *, verified: bool, executable: bool, weights: dict[str, float] | None = None
) -> StructuralScore:
    w = weights or load_weights()
    vec = match_vector(target, cand, verified=verified, executable=executable)
    contrib = {k: w[k] * v for k, v in vec.items() if v}
    return StructuralScore(sum(contrib.values()), contrib)
