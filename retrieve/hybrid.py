"""Hybrid retrieval: embedding similarity + structural score + measured performance.

total = w_embedding * similarity + sum(structural terms) + w_perf * perf, where similarity is
1 - cosine distance of the IR/feature text, the structural terms come from
`retrieve.structural`, and perf is the candidate's best measured TFLOP/s on the target arch
relative to the best candidate (0 when none was measured). All weights live in one table
(`retrieve/weights.json` once fitted). Every ranked row keeps its terms for `kb query`.
"""

from __future__ import annotations

import functools
import heapq
import logging
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from sqlmodel import func, select

from kb.features import Features
from kb.store.kb import KnowledgeBase
from kb.store.models import Kernel, Lesson, PerfRecord, Snippet
from kb.store.records import EMBEDDED
from retrieve.structural import load_weights, match_vector

__all__ = ["Filters", "RankedKernel", "RankedSnippet", "QueryResult", "Mode", "query", "needed_snippet_kinds"]

log = logging.getLogger(__name__)

Mode = Literal["hybrid", "embedding", "structural"]
PROGRAM_PREFIX = "program "  # IR text of a complete program starts so; snippet-only rows do not
EMBED_POOL = 200  # nearest embeddings fetched per query; the rest count as similarity 0


@dataclass(frozen=True)
class Filters:
    arch: str | None = None
    dtype: str | None = None
    head_dim: int | None = None
    decode: bool | None = None  # True: split-KV/decode kernels only; False: forward only
    programs_only: bool = True  # only kernels with an executable program (not snippet-only rows)
    memory: bool = True  # include generated kernels and lessons (write-back memory)


@dataclass(frozen=True)
class RankedKernel:
    id: str
    name: str
    family: str
    origin: str
    score: float
    terms: dict[str, float]  # term -> contribution to score
    features: Features


@dataclass(frozen=True)
class RankedSnippet:
    id: str
    kind: str
    title: str
    ir_text: str
    where: str  # "dist==ver file:L1-L2"
    similarity: float


@dataclass(frozen=True)
class QueryResult:
    target: Features | None
    kernels: list[RankedKernel]
    snippets: list[RankedSnippet]
    lessons: list[str] = field(default_factory=list)


def needed_snippet_kinds(f: Features) -> list[str]:
    """The snippet kinds a transfer to `f` draws on."""
    kinds = ["online_softmax", "epilogue"]
    kinds += {"causal": ["mask_causal", "kv_loop_bounds"], "sliding_window": ["mask_local", "kv_loop_bounds"],
              "document": ["mask_mod", "block_sparse"], "prefix_lm": ["mask_mod"], "block_sparse": ["block_sparse"],
              "custom": ["mask_mod"]}.get(f.mask, [])
    kinds += {"alibi": ["alibi"], "softcap": ["softcap"], "relative_bias": ["score_mod"],
              "bias_table": ["score_mod"], "custom": ["score_mod"]}.get(f.score_mod, [])
    if f.gqa_ratio > 1:
        kinds.append("gqa")
    if f.split_kv or f.decode:
        kinds.append("split_kv_combine")
    for flag, kind in (("paged_kv", "paged_kv"), ("varlen", "varlen"), ("dropout", "dropout")):
        if getattr(f, flag):
            kinds.append(kind)
    return kinds


def _passes(k: "_Row", f: Features, flt: Filters) -> bool:
    if flt.arch and k.arch not in ("any", flt.arch):
        return False
    if flt.dtype and k.dtype and k.dtype != flt.dtype:
        return False
    if flt.head_dim and k.head_dim and k.head_dim != flt.head_dim:
        return False
    if flt.decode is not None and (f.split_kv or f.decode) != flt.decode:
        return False
    if not flt.memory and k.origin == "generated":
        return False
    return True


_GPU_ARCH = {"A100": "sm80", "A10": "sm86", "L4": "sm89", "H100": "sm90", "H200": "sm90", "H800": "sm90", "B200": "sm100"}


def gpu_arch(gpu_name: str) -> str:
    """'NVIDIA H200' -> 'sm90'; unknown names -> ''."""
    for key, arch in _GPU_ARCH.items():
        if key in (gpu_name or "").upper():
            return arch
    return ""


def _perf_terms(kb: KnowledgeBase, ids: list[str], arch: str | None) -> dict[str, float]:
    if not ids:
        return {}
    # all measured records, filtered here: an IN list of every candidate id costs more than the
    # (small) perf table, and compiles one bound parameter per id
    wanted = set(ids)
    with kb.read_session() as s:
        rows = s.exec(select(PerfRecord).where(PerfRecord.kind == "measured")).all()
    best: dict[str, float] = {}
    for r in rows:
        if r.kernel_id in wanted and r.tflops and (arch in (None, "any") or gpu_arch(r.gpu) == arch):
            best[r.kernel_id] = max(best.get(r.kernel_id, 0.0), r.tflops)
    top = max(best.values(), default=0.0)
    return {k: v / top for k, v in best.items()} if top else {}


def query(
    kb: KnowledgeBase,
    text: str,
    target: Features | None = None,
    *,
    k: int = 5,
    filters: Filters = Filters(),
    mode: Mode = "hybrid",
    weights: dict[str, float] | None = None,
    snippets_per_kind: int = 1,
) -> QueryResult:
    """Rank kernels for `text` (the spec's IR/feature description) and `target` features.

    One model call embeds the query text and the snippet-kind texts; the candidate table is
    read without IR text, parsed features are cached by their JSON, structural terms are
    computed once per distinct (features, verified, executable), and only the top `k` rows
    become `RankedKernel`s.
    """
    w = weights or load_weights()
    table = _candidate_table(kb)
    kinds = needed_snippet_kinds(target) if target is not None else []
    qvec, *kind_vecs = kb.embedder.embed([text] + [f"{kind}: {text}" for kind in kinds])  # one model call
    sims = {kid: 1.0 - dist for kid, dist in _nearest(kb, "kernels", qvec, min(EMBED_POOL, max(1, table.size)))}
    groups = [g for g in table.groups if (not filters.programs_only or g.rep.executable) and _passes(g.rep, g.features, filters)]
    perf = _perf_terms(kb, [r.id for g in groups for r in g.rows], filters.arch) if mode == "hybrid" else {}
    scored = []
    for g in groups:
        shared: dict[str, float] = {}
        if mode in ("hybrid", "structural") and target is not None:
            vec = match_vector(target, g.features, verified=g.rep.verified, executable=g.rep.executable)
            shared = {t: w[t] * v for t, v in vec.items() if v and w.get(t)}
        # rows without a per-row term all score `shared`: only the first k of them (by id) can rank
        plain = 0
        for kern in g.rows:
            if kern.id not in sims and kern.id not in perf:
                if plain >= k:
                    continue
                plain += 1
            own: dict[str, float] = {}
            if mode in ("hybrid", "embedding"):
                own["embedding"] = w.get("embedding", 1.0) * sims.get(kern.id, 0.0)
            if kern.id in perf:
                own["perf"] = w.get("perf", 0.5) * perf[kern.id]
            terms = {**own, **shared}
            scored.append((-sum(terms.values()), kern.id, kern, g.features, terms))
    top = heapq.nsmallest(k, scored, key=lambda e: (e[0], e[1]))  # == sorted(...)[:k]
    ranked = [RankedKernel(kern.id, kern.name, kern.family, kern.origin, sum(terms.values()), terms, f)
              for _, _, kern, f, terms in top]
    snippets = _snippets(kb, kinds, kind_vecs, snippets_per_kind)
    lessons = _lessons(kb, qvec, target) if filters.memory else []
    return QueryResult(target, ranked, snippets, lessons)


class _Row(NamedTuple):  # a NamedTuple: built 10k times per query, a frozen dataclass costs 10x
    """The columns ranking reads from a kernel row (no IR text, no sources)."""

    id: str
    name: str
    family: str
    origin: str
    features_json: str
    arch: str
    dtype: str
    head_dim: int | None
    verified: bool
    executable: bool  # a complete program, not snippets only


class _Group(NamedTuple):
    """Kernels that rank alike: same features, verified/executable flags and filter columns."""

    features: Features
    rep: _Row  # the first row; its filter columns stand for the group
    rows: list[_Row]  # sorted by id


class _Table(NamedTuple):
    marker: tuple
    size: int
    groups: list[_Group]


_TABLES: dict[str, _Table] = {}


def _marker(kb: KnowledgeBase) -> tuple:
    """Changes whenever kernels are added or their ranking columns change (ids are content hashes)."""
    stmt = select(func.count(Kernel.id), func.max(Kernel.created_at), func.sum(func.length(Kernel.features_json)),
                  func.sum(Kernel.verified))
    with kb.read_session() as s:
        return tuple(s.execute(stmt).one())


def _candidate_table(kb: KnowledgeBase) -> _Table:
    """The grouped candidate rows of `kb`, rebuilt only when the kernels table changed."""
    key = kb.settings.resolved_db_url
    marker = _marker(kb)
    cached = _TABLES.get(key)
    if cached is not None and cached.marker == marker:
        return cached
    rows = _candidates(kb)
    by_key: dict[tuple, list[_Row]] = {}
    for r in sorted(rows, key=lambda r: r.id):
        by_key.setdefault((r.features_json, r.verified, r.executable, r.arch, r.dtype, r.head_dim, r.origin), []).append(r)
    groups = [_Group(_features(fj), rs[0], rs) for (fj, *_), rs in by_key.items()]
    _TABLES[key] = table = _Table(marker, len(rows), groups)
    return table


def _candidates(kb: KnowledgeBase) -> list[_Row]:
    prefix = func.substr(Kernel.ir_text, 1, len(PROGRAM_PREFIX)) == PROGRAM_PREFIX
    cols = (Kernel.id, Kernel.name, Kernel.family, Kernel.origin, Kernel.features_json, Kernel.arch,
            Kernel.dtype, Kernel.head_dim, Kernel.verified, prefix)
    with kb.read_session() as s:
        return [_Row(*r[:9], bool(r[9])) for r in s.execute(select(*cols))]  # type: ignore[call-overload]


@functools.lru_cache(maxsize=65536)
def _features(features_json: str) -> Features:
    return Features.from_json(features_json)


def _nearest(kb: KnowledgeBase, collection: str, vec: list[float], k: int,
             where: dict[str, object] | None = None) -> list[tuple[str, float]]:
    """`KnowledgeBase.vector_query` for an already embedded query (ids without a SQL row dropped)."""
    hits = kb.vectors.query(collection, vec, k, where)
    if not hits:
        return []
    table = EMBEDDED[collection]
    with kb.read_session() as s:
        known = set(s.exec(select(table.id).where(table.id.in_([h[0] for h in hits]))))  # type: ignore[attr-defined]
    if len(known) < len(hits):
        log.warning("%d %s embeddings have no row; run `kb doctor --fix`", len(hits) - len(known), collection)
    return [h for h in hits if h[0] in known]


def _snippets(kb: KnowledgeBase, kinds: list[str], vecs: list[list[float]], per_kind: int) -> list[RankedSnippet]:
    out: list[RankedSnippet] = []
    with kb.read_session() as s:
        for kind, vec in zip(kinds, vecs):
            for sid, dist in _nearest(kb, "snippets", vec, per_kind, where={"kind": kind}):
                sn = s.get(Snippet, sid)
                if sn is not None:
                    out.append(RankedSnippet(sn.id, sn.kind, sn.title, sn.ir_text, _where(kb, sn), 1.0 - dist))
    return out


def _where(kb: KnowledgeBase, sn: Snippet) -> str:
    src = sn.source_id or "local"
    span = f":{sn.line_start}-{sn.line_end}" if sn.line_start else ""
    return f"{src} {sn.file}{span}"


def _lessons(kb: KnowledgeBase, qvec: list[float], target: Features | None, k: int = 5) -> list[str]:
    hits = _nearest(kb, "lessons", qvec, k)
    out = []
    with kb.read_session() as s:
        for lid, _ in hits:
            les = s.get(Lesson, lid)
            if les is None:
                continue
            if target is not None:
                lf = Features.from_json(les.features_json or "{}")
                if lf.mask != target.mask and lf.score_mod != target.score_mod:
                    continue
            out.append(les.text)
    return out


def describe_target(f: Features, score_mod: str | None, mask_mod: str | None) -> str:
    """The text embedded for a query: feature sentence plus the variant expressions."""
    parts = [f.describe()]
    if mask_mod:
        parts.append(f"mask_mod: {mask_mod}")
    if score_mod:
        parts.append(f"score_mod: {score_mod}")
    return "; ".join(parts)
