"""Retrieval stays exact while it is fast: vectorised structural terms, pruned ranking, table cache.

The terms are checked against a per-pair oracle written out here; `query` rankings against a
brute-force ranking of every kernel row, on a KB (real SQLite and Chroma in tmp_path) with many
feature groups, ties, perf records and a small embedding pool, so most rows are pruned.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Sequence
from datetime import UTC, datetime

import numpy as np
import pytest
from sqlmodel import Session, select

from kb.features import MASK_KINDS, SCORE_KINDS, Features
from kb.settings import load_settings
from kb.store import Kernel, KernelBundle, PerfRecord, open_kb
from kb.store.records import assign_id, embedding_doc
from retrieve import hybrid
from retrieve.hybrid import Filters, query
from retrieve.structural import TERMS, candidate_columns, load_weights, match_vector, term_columns


def _oracle_terms(t: Features, c: Features, verified: bool, executable: bool) -> dict[str, float]:
    """The terms as written per pair before they were vectorised (the meaning of TERMS)."""
    hd_ratio = 1.0 if c.head_dim == 0 else max(t.head_dim, c.head_dim) / max(1, min(t.head_dim, c.head_dim))
    return {
        "mask_same": float(t.mask == c.mask), "mask_none_vs_some": float((t.mask == "none") != (c.mask == "none")),
        "causal_same": float(t.causal == c.causal), "window_same": float(t.sliding_window == c.sliding_window),
        "score_same": float(t.score_mod == c.score_mod), "score_missing": float(t.score_mod != "none" and c.score_mod == "none"),
        "split_same": float(t.split_kv == c.split_kv), "decode_same": float(t.decode == c.decode),
        "gqa_target": float(t.gqa_ratio > 1 and c.gqa_ratio > 1),
        "paged_same": float(t.paged_kv == c.paged_kv), "varlen_same": float(t.varlen == c.varlen),
        "head_dim_same": float(t.head_dim == c.head_dim),
        "head_dim_close": float(hd_ratio <= 2), "dtype_same": float(t.dtype == c.dtype),
        "arch_ok": float(c.arch in ("any", t.arch) or t.arch == "any"), "lse_same": float(t.return_lse == c.return_lse),
        "verified": float(verified), "executable": float(executable), "bias": 1.0,
    }


def _random_features(rng: random.Random) -> Features:
    mask = rng.choice(MASK_KINDS + ("unheard_of",))
    return Features(mask=mask, causal=rng.random() < 0.5, sliding_window=rng.random() < 0.3,
                    score_mod=rng.choice(SCORE_KINDS), gqa_ratio=rng.choice((1, 2, 8)),
                    head_dim=rng.choice((0, 1, 32, 64, 96, 128, 200, 256, 512)), dtype=rng.choice(("bf16", "fp16", "fp32", "")),
                    split_kv=rng.random() < 0.3, decode=rng.random() < 0.3, return_lse=rng.random() < 0.5,
                    paged_kv=rng.random() < 0.2, varlen=rng.random() < 0.2, arch=rng.choice(("any", "sm80", "sm90", "sm100")))


def test_term_columns_equal_single_pair_terms() -> None:
    rng = random.Random(7)
    cands = [(_random_features(rng), rng.random() < 0.5, rng.random() < 0.5) for _ in range(400)]
    cands += [(Features(head_dim=0), True, True), (Features(mask="none", score_mod="none", arch="any"), False, False)]
    cols = candidate_columns(cands)
    for target in [_random_features(rng) for _ in range(40)] + [Features(), Features(arch="any", head_dim=0)]:
        terms = term_columns(target, cols)
        assert list(terms) == list(TERMS)
        for i, (c, verified, executable) in enumerate(cands):
            want = _oracle_terms(target, c, verified, executable)
            assert {t: float(v[i]) for t, v in terms.items()} == want
            assert match_vector(target, c, verified=verified, executable=executable) == want


# ---- query() against brute force


class HashEmbedder:
    """Deterministic unit vectors from a text hash (the ranking logic, not the model, is under test)."""

    name = "hash-16"

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        out = []
        for t in texts:
            v = np.random.default_rng(int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little")).standard_normal(16)
            out.append((v / np.linalg.norm(v)).tolist())
        return out


def _kernel(i: int) -> KernelBundle:
    """Few distinct feature sets, so groups hold several rows and many groups tie."""
    mask = ("none", "causal", "sliding_window")[i % 3]
    f = Features(mask=mask, causal=mask == "causal", sliding_window=mask == "sliding_window",
                 score_mod=("none", "softcap")[(i // 3) % 2], head_dim=(64, 128)[(i // 6) % 2],
                 arch=("any", "sm90")[(i // 12) % 2], dtype=("bf16", "fp16")[(i // 24) % 2], split_kv=i % 13 == 0,
                 decode=i % 13 == 0)
    ir = f"program synth_{i}(q)\n  mask {f.mask}\n" if i % 11 else f"snippets: mask {f.mask} {i}"
    perf = []
    if i % 4 == 1:
        perf = [PerfRecord(kind="measured", gpu=("NVIDIA H200", "NVIDIA A100")[i % 3 == 0], ms=1.0, tflops=float(50 + i % 9),
                           command="bench", measured_at=datetime(2026, 1, 1, tzinfo=UTC))]
    kern = Kernel(name=f"synth_{i}", family="fa2_triton", origin="generated" if i % 7 == 0 else "ingest", ir_text=ir,
                  features_json=f.to_json(), arch=f.arch, dtype=f.dtype if i % 17 else "", head_dim=f.head_dim if i % 5 else None,
                  verified=i % 5 != 0)
    return KernelBundle(kern, perf=perf)


@pytest.fixture(scope="module")
def many_groups_kb(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("KB_")]:
            mp.delenv(name)
        settings = load_settings(home=tmp_path_factory.mktemp("retrieve-exact") / "kb")
    with open_kb(settings, embedder=HashEmbedder()) as store:
        store.write_kernels(_kernel(i) for i in range(90))
        yield store


def _passes(kern: Kernel, f: Features, flt: Filters) -> bool:
    return ((not flt.programs_only or kern.ir_text.startswith(hybrid.PROGRAM_PREFIX))
            and not (flt.arch and kern.arch not in ("any", flt.arch))
            and not (flt.dtype and kern.dtype and kern.dtype != flt.dtype)
            and not (flt.head_dim and kern.head_dim and kern.head_dim != flt.head_dim)
            and not (flt.decode is not None and (f.split_kv or f.decode) != flt.decode)
            and not (not flt.memory and kern.origin == "generated"))


def _brute_force(kb, text: str, target: Features | None, k: int, flt: Filters, mode: str,
                 w: dict[str, float]) -> list[tuple[str, float]]:
    """Every kernel row scored on its own: sum of {embedding, perf, structural terms}, sorted by (-score, id)."""
    sims = {}
    if mode != "structural":
        sims = {kid: 1.0 - d for kid, d in kb.vectors.query("kernels", kb.embedder.embed([text])[0], hybrid.EMBED_POOL)}
    with kb.read_session() as s:
        kernels = [kn for kn in s.exec(select(Kernel)).all() if _passes(kn, Features.from_json(kn.features_json), flt)]
        records = s.exec(select(PerfRecord).where(PerfRecord.kind == "measured")).all()
    ids = {kn.id for kn in kernels}
    best: dict[str, float] = {}
    for r in records:
        if mode == "hybrid" and r.kernel_id in ids and r.tflops and (flt.arch in (None, "any") or hybrid.gpu_arch(r.gpu) == flt.arch):
            best[r.kernel_id] = max(best.get(r.kernel_id, 0.0), r.tflops)
    scored = []
    for kn in kernels:
        terms = {}
        if mode != "structural":
            terms["embedding"] = w["embedding"] * sims.get(kn.id, 0.0)
        if kn.id in best:
            terms["perf"] = w["perf"] * best[kn.id] / max(best.values())
        if mode != "embedding" and target is not None:
            vec = match_vector(target, Features.from_json(kn.features_json), verified=kn.verified,
                               executable=kn.ir_text.startswith(hybrid.PROGRAM_PREFIX))
            terms.update({t: w[t] * v for t, v in vec.items() if v and w[t]})
        scored.append((-sum(terms.values()), kn.id))
    return [(kid, -neg) for neg, kid in sorted(scored)[:k]]


TARGETS = [None, Features(mask="causal", causal=True, head_dim=128, arch="sm90"),
           Features(mask="sliding_window", sliding_window=True, score_mod="softcap", head_dim=64),
           Features(split_kv=True, decode=True, gqa_ratio=4, arch="sm80")]
FILTERS = [Filters(), Filters(memory=False), Filters(programs_only=False), Filters(arch="sm90"),
           Filters(head_dim=64, dtype="bf16"), Filters(decode=False)]
UNIT = {t: 1.0 for t in [*TERMS, "embedding", "perf"]}


@pytest.mark.parametrize("mode", ["hybrid", "embedding", "structural"])
@pytest.mark.parametrize("weights", ["fitted", "unit"])
@pytest.mark.parametrize("pool", [6, 40])  # few rows with an embedding term: most take the pruned path
def test_query_ranking_equals_brute_force(many_groups_kb, monkeypatch: pytest.MonkeyPatch, mode: str, weights: str,
                                          pool: int) -> None:
    monkeypatch.setattr(hybrid, "EMBED_POOL", pool)
    w = load_weights() if weights == "fitted" else UNIT
    for ti, target in enumerate(TARGETS):
        text = f"query {ti}"
        for flt in FILTERS:
            for k in (1, 4, 13, 1000):
                res = query(many_groups_kb, text, target, k=k, filters=flt, mode=mode, weights=w)  # type: ignore[arg-type]
                want = _brute_force(many_groups_kb, text, target, k, flt, mode, w)
                assert [r.id for r in res.kernels] == [kid for kid, _ in want], (target, flt, k)
                assert [r.score for r in res.kernels] == pytest.approx([score for _, score in want])
                assert all(r.score == sum(r.terms.values()) for r in res.kernels)


def test_cached_table_follows_writes(many_groups_kb) -> None:
    """A kernel written, or a verified flag flipped, after a query shows in the next query."""
    target = Features(mask="causal", causal=True, head_dim=96, dtype="fp16", arch="sm100", gqa_ratio=2, return_lse=True)
    exact = Kernel(name="exact", family="fa2_triton", ir_text="program exact(q)\n", features_json=target.to_json(),
                   arch="sm100", dtype="fp16", head_dim=96, verified=True)
    assert "exact" not in [r.name for r in query(many_groups_kb, "q", target, k=3, mode="structural").kernels]
    kid = many_groups_kb.write_kernel(exact)
    top = query(many_groups_kb, "q", target, k=3, mode="structural").kernels[0]
    assert top.name == "exact" and "verified" in top.terms
    with Session(many_groups_kb.engines.write) as s:  # what `kb doctor --fix` does to a corrupt row
        s.get(Kernel, kid).verified = False
        s.commit()
    top = query(many_groups_kb, "q", target, k=3, mode="structural").kernels[0]
    assert top.name == "exact" and "verified" not in top.terms


def test_tied_groups_rank_by_their_first_row_without_embedding_term(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tied groups, ids a1 < b1 < a2 with a1, a2 in one group and a1 the (penalised) embedding hit: b1 ranks first."""
    monkeypatch.setattr(hybrid, "EMBED_POOL", 1)
    kernels = sorted((assign_id(Kernel(name=f"t{j}", family="fa2_triton", ir_text=f"program t{j}(q)\n",
                                       features_json=Features().to_json(), dtype="bf16", head_dim=128)) for j in range(3)),
                     key=lambda kn: kn.id)
    a1, b1, a2 = kernels
    b1.verified = False  # its own group; with no target every group scores 0
    a1.verified = a2.verified = True
    w = {**load_weights(), "embedding": -1.0}
    with open_kb(load_settings(home=tmp_path / "kb"), embedder=HashEmbedder()) as kb:
        kb.write_kernels([KernelBundle(a1), KernelBundle(b1), KernelBundle(a2)])
        text = embedding_doc(a1).document  # a1 is the one nearest neighbour
        for k, want in ((1, [b1]), (2, [b1, a2]), (3, [b1, a2, a1])):
            assert [r.id for r in query(kb, text, None, k=k, weights=w).kernels] == [kn.id for kn in want]
            assert [kn.id for kn in want] == [kid for kid, _ in _brute_force(kb, text, None, k, Filters(), "hybrid", w)]
