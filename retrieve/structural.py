"""Structural similarity: an additive model over feature matches (SparseDitto-style ranking).

`term_columns(target, columns)` is the one definition of the named indicator terms: it
compares spec features with many candidates at once, read from numpy columns
(`candidate_columns`, strings integer-coded). `match_vector(target, candidate)` is the same
for one (spec features, kernel features) pair. The score is the dot product with one
visible weight table. Weights are fitted on the labelled spec set by
`bench/fit_retrieval.py` (logistic regression) and saved to `retrieve/weights.json`, shipped
as package data; a missing file is an error, never a silent fall back to `DEFAULT_WEIGHTS`
(the starting point of a fit).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kb.errors import KBError
from kb.features import Features

__all__ = ["TERMS", "HYBRID_TERMS", "Coded", "coded", "CandidateColumns", "candidate_columns", "term_columns", "match_vector",
           "StructuralScore", "structural_score", "load_weights", "WEIGHTS_PATH"]

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
    "paged_same": "both read K/V through a page table or token pool, or both not",
    "varlen_same": "both take packed variable-length sequences, or both not",
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
    "gqa_target": 0.5, "paged_same": 1.5, "varlen_same": 1.0, "head_dim_same": 0.5, "head_dim_close": 0.25, "dtype_same": 0.25,
    "arch_ok": 0.5, "lse_same": 0.1, "verified": 1.0, "executable": 1.0, "bias": 0.0,
}


class Coded(NamedTuple):
    """A string column as integer codes; `vocab` maps each string to its code."""

    codes: np.ndarray
    vocab: dict[str, int]

    def eq(self, value: str) -> np.ndarray:
        return self.codes == self.vocab.get(value, -1)


def coded(values: Sequence[str]) -> Coded:
    vocab: dict[str, int] = {}
    codes = np.fromiter((vocab.setdefault(v, len(vocab)) for v in values), dtype=np.int64, count=len(values))
    return Coded(codes, vocab)


class CandidateColumns(NamedTuple):
    """Exactly what the terms read from candidates, one entry per candidate."""

    mask: Coded
    score_mod: Coded
    dtype: Coded
    arch: Coded
    causal: np.ndarray  # bool columns
    sliding_window: np.ndarray
    split_kv: np.ndarray
    decode: np.ndarray
    paged_kv: np.ndarray
    varlen: np.ndarray
    return_lse: np.ndarray
    backward: np.ndarray
    verified: np.ndarray
    executable: np.ndarray
    gqa_ratio: np.ndarray  # int columns
    head_dim: np.ndarray


def candidate_columns(cands: Sequence[tuple[Features, bool, bool]]) -> CandidateColumns:
    """Columns of (features, verified, executable) candidates, for `term_columns`."""
    fs = [f for f, _, _ in cands]

    def col(values: Iterable[object], dtype: type) -> np.ndarray:
        return np.fromiter(values, dtype=dtype, count=len(fs))

    return CandidateColumns(
        mask=coded([f.mask for f in fs]), score_mod=coded([f.score_mod for f in fs]),
        dtype=coded([f.dtype for f in fs]), arch=coded([f.arch for f in fs]),
        causal=col((f.causal for f in fs), bool), sliding_window=col((f.sliding_window for f in fs), bool),
        split_kv=col((f.split_kv for f in fs), bool), decode=col((f.decode for f in fs), bool),
        paged_kv=col((f.paged_kv for f in fs), bool), varlen=col((f.varlen for f in fs), bool),
        return_lse=col((f.return_lse for f in fs), bool), backward=col((f.backward for f in fs), bool), verified=col((v for _, v, _ in cands), bool),
        executable=col((e for _, _, e in cands), bool), gqa_ratio=col((f.gqa_ratio for f in fs), np.int64),
        head_dim=col((f.head_dim for f in fs), np.int64),
    )


def term_columns(target: Features, c: CandidateColumns) -> dict[str, np.ndarray]:
    """Every indicator term of `target` against every candidate: keys exactly TERMS, float64 columns."""
    hd, t_hd = c.head_dim, target.head_dim
    # head_dim 0 = the program takes any head dim (HEAD_PAD decided at launch)
    hd_ratio = np.where(hd == 0, 1.0, np.maximum(t_hd, hd) / np.maximum(1, np.minimum(t_hd, hd)))
    vals = {
        "mask_same": c.mask.eq(target.mask),
        "mask_none_vs_some": (target.mask == "none") != c.mask.eq("none"),
        "causal_same": c.causal == target.causal,
        "window_same": c.sliding_window == target.sliding_window,
        "score_same": c.score_mod.eq(target.score_mod),
        "score_missing": (target.score_mod != "none") & c.score_mod.eq("none"),
        "split_same": c.split_kv == target.split_kv,
        "decode_same": c.decode == target.decode,
        "gqa_target": (target.gqa_ratio > 1) & (c.gqa_ratio > 1),
        "paged_same": c.paged_kv == target.paged_kv,
        "varlen_same": c.varlen == target.varlen,
        "head_dim_same": hd == t_hd,
        "head_dim_close": hd_ratio <= 2,
        "dtype_same": c.dtype.eq(target.dtype),
        "arch_ok": c.arch.eq("any") | c.arch.eq(target.arch) | (target.arch == "any"),
        "lse_same": c.return_lse == target.return_lse,
        "verified": c.verified,
        "executable": c.executable,
        "bias": np.ones(len(hd), dtype=bool),
    }
    return {t: v.astype(np.float64) for t, v in vals.items()}


def match_vector(target: Features, cand: Features, *, verified: bool, executable: bool) -> dict[str, float]:
    """Indicator terms for one (target, candidate) pair; keys are exactly TERMS."""
    cols = candidate_columns([(cand, verified, executable)])
    return {t: float(v[0]) for t, v in term_columns(target, cols).items()}


@dataclass(frozen=True)
class StructuralScore:
    total: float
    terms: dict[str, float]  # term -> weight * value (the contribution), for explanations


def load_weights(path: Path = WEIGHTS_PATH) -> dict[str, float]:
    """The fitted weights; a missing file, or a structural term missing from it, is an error.

    The result always has every TERMS and HYBRID_TERMS key (hybrid terms the file lacks keep their default).
    """
    if not path.is_file():
        raise KBError(f"the fitted retrieval weights {path} are missing",
                      hint="reinstall kernel-kb, or write them with `python -m bench.fit_retrieval --home KB_DIR --write` in a checkout")
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
