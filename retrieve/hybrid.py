"""Hybrid retrieval: embedding similarity + structural score + measured performance.

total = w_embedding * similarity + sum(structural terms) + w_perf * perf, where similarity is
1 - cosine distance of the IR/feature text, the structural terms come from
`retrieve.structural`, and perf is the candidate's best measured TFLOP/s on the target arch
relative to the best candidate (0 when none was measured). All weights live in one table
(`retrieve/weights.json` once fitted). Every ranked row keeps its terms for `kb query`.
Quarantined kernels (`kb doctor --fix`) and kernels whose stored features break their typed rule are never
candidates; the latter are named in one warning.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
from sqlalchemy import Integer, cast
from sqlmodel import Session, func, select

from kb.features import Features
from kb.store.kb import KnowledgeBase
from kb.store.models import Kernel, Lesson, PerfRecord, Snippet
from kb.store.payloads import features_problems
from retrieve.structural import CandidateColumns, Coded, candidate_columns, coded, load_weights, term_columns

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
    backward: bool = False  # True: backward programs only; False: forward programs only
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


_GPU_ARCH = {"A100": "sm80", "A10": "sm86", "L4": "sm89", "H100": "sm90", "H200": "sm90", "H800": "sm90", "B200": "sm100"}


def gpu_arch(gpu_name: str) -> str:
    """'NVIDIA H200' -> 'sm90'; unknown names -> ''."""
    for key, arch in _GPU_ARCH.items():
        if key in (gpu_name or "").upper():
            return arch
    return ""


def _perf_terms(kb: KnowledgeBase, table: _Table, ok: np.ndarray, arch: str | None) -> dict[str, float]:
    """Best measured TFLOP/s on `arch` of the passing rows (`ok` per group), relative to the best of them."""
    # all measured records, filtered here: an IN list of every candidate id costs more than the
    # (small) perf table, and compiles one bound parameter per id
    with kb.read_session() as s:
        rows = s.execute(select(PerfRecord.kernel_id, PerfRecord.gpu, PerfRecord.tflops)
                         .where(PerfRecord.kind == "measured")).all()
    best: dict[str, float] = {}
    for kid, gpu, tflops in rows:
        at = table.where.get(kid)
        if at is not None and ok[at[0]] and tflops and (arch in (None, "any") or gpu_arch(gpu) == arch):
            best[kid] = max(best.get(kid, 0.0), tflops)
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

    One model call embeds the query text; its vector finds the nearest kernels, the snippets
    of each needed kind (a Chroma `kind` filter) and lessons. The candidate table is cached
    per KB, grouped by everything ranking reads, with numpy columns per group: filters and
    structural terms are computed for all groups at once. Only rows that can reach the top
    `k` are scored one by one (see `_contenders`), and only the top `k` become `RankedKernel`s.
    """
    w = weights or load_weights()
    table = _candidate_table(kb)
    qvec = kb.embedder.embed([text])[0]
    ok = _passing(table, filters)
    sims = _kernel_sims(kb, table, qvec) if mode != "structural" else {}
    perf = _perf_terms(kb, table, ok, filters.arch) if mode == "hybrid" else {}
    shared: dict[str, np.ndarray] = {}  # term -> weighted contribution per group
    if mode != "embedding" and target is not None:
        shared = {t: w[t] * v for t, v in term_columns(target, table.columns).items() if w.get(t)}
    ranked = _top(table, ok, _Scorer(mode, w, sims, perf, shared), k)
    kinds = needed_snippet_kinds(target) if target is not None else []
    snippets = _snippets(kb, kinds, qvec, snippets_per_kind)
    lessons = _lessons(kb, qvec, target) if filters.memory else []
    return QueryResult(target, ranked, snippets, lessons)


class _Scorer(NamedTuple):
    """A query's ranking terms: per row (embedding, perf) and per group (structural)."""

    mode: Mode
    weights: dict[str, float]
    sims: dict[str, float]
    perf: dict[str, float]
    shared: dict[str, np.ndarray]  # term -> weighted contribution per group

    def group_scores(self, n_groups: int) -> np.ndarray:
        """What a row without embedding or perf term scores, per group."""
        return _fold(self.shared.values(), n_groups)

    def own(self, kid: str) -> dict[str, float]:
        own: dict[str, float] = {}
        if self.mode in ("hybrid", "embedding"):
            own["embedding"] = self.weights.get("embedding", 1.0) * self.sims.get(kid, 0.0)
        if kid in self.perf:
            own["perf"] = self.weights.get("perf", 0.5) * self.perf[kid]
        return own

    def totals(self, rows: list[tuple[int, _Row]]) -> np.ndarray:
        """Scores of (group, row) pairs, bit-identical to `sum(self.terms(...).values())`."""
        gis = np.fromiter((gi for gi, _ in rows), dtype=np.int64, count=len(rows))
        own = [self.own(r.id) for _, r in rows]
        per_row = [np.fromiter((o.get(t, 0.0) for o in own), dtype=np.float64, count=len(rows)) for t in ("embedding", "perf")]
        return _fold([*per_row, *(v[gis] for v in self.shared.values())], len(rows))

    def terms(self, gi: int, kid: str) -> dict[str, float]:
        """The explained terms of one row (term -> contribution), zero structural terms left out."""
        return {**self.own(kid), **{t: float(v[gi]) for t, v in self.shared.items() if v[gi]}}


def _top(table: _Table, ok: np.ndarray, scorer: _Scorer, k: int) -> list[RankedKernel]:
    """The `k` best passing rows by (-score, id), each with its terms."""
    rows = _contenders(table, ok, scorer, k)
    top = heapq.nsmallest(k, zip((-s for s in scorer.totals(rows).tolist()), (r.id for _, r in rows), rows))
    ranked = []
    for _, _, (gi, r) in top:
        terms = scorer.terms(gi, r.id)
        ranked.append(RankedKernel(r.id, r.name, r.family, r.origin, sum(terms.values()), terms, table.groups[gi].features))
    return ranked


def _fold(parts: Iterable[np.ndarray], n: int) -> np.ndarray:
    # left to right from 0, the order `sum(terms.values())` adds in, so scores (and ties) are exact;
    # zero parts change no sum
    total = np.zeros(n)
    for p in parts:
        total += p
    return total


def _contenders(table: _Table, ok: np.ndarray, scorer: _Scorer, k: int) -> list[tuple[int, _Row]]:
    """Every (group, row) that can be in the top `k`, in no particular order.

    Rows with an embedding or perf term are scored one by one. Every other row scores its
    group's structural score, so ranks by (group score, id): only the k groups with the best
    (group score, first such id) can hold one of the k best, and only their first k such rows.
    """
    if k <= 0:
        return []
    special = [at for kid in (scorer.sims.keys() | scorer.perf.keys()) if (at := table.where.get(kid)) and ok[at[0]]]
    skip = {r.id for _, r in special}
    plain = [(gi, r) for gi in _plain_groups(table, ok, scorer, skip, k)
             for r in itertools.islice((r for r in table.groups[gi].rows if r.id not in skip), k)]
    return special + plain


def _plain_groups(table: _Table, ok: np.ndarray, scorer: _Scorer, skip: set[str], k: int) -> list[int]:
    """The (at most k) passing groups whose best row outside `skip` ranks among the k best such rows."""
    n_special = np.bincount(np.fromiter((table.where[kid][0] for kid in skip), dtype=np.int64, count=len(skip)),
                            minlength=len(table.groups))
    idx = np.flatnonzero(ok & (table.sizes > n_special))
    if len(idx) <= k:
        return idx.tolist()
    score = scorer.group_scores(len(table.groups))[idx]
    keep = score >= np.partition(score, len(idx) - k)[len(idx) - k]  # cheap cut before sorting the ties
    idx, score = idx[keep], score[keep]
    if len(idx) <= k:
        return idx.tolist()
    first = table.first_ids[idx]  # fancy indexing copies
    for j in np.flatnonzero(n_special[idx]).tolist():
        first[j] = next(r.id for r in table.groups[idx[j]].rows if r.id not in skip)
    return idx[np.lexsort((first, -score))[:k]].tolist()


class _Row(NamedTuple):  # a NamedTuple: built 10k times per table, a frozen dataclass costs 10x
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


class _FilterColumns(NamedTuple):
    """The row columns `Filters` test, per group (from the group's representative row)."""

    arch: Coded
    dtype: Coded  # "" = no dtype recorded
    head_dim: np.ndarray  # 0 = no head dim recorded
    generated: np.ndarray


class _Table(NamedTuple):
    """The candidate rows of a KB grouped, with numpy columns per group for filters and structural terms."""

    marker: tuple  # `_marker` when read
    seen: tuple | None  # `_db_version` when `marker` was last current
    size: int
    groups: list[_Group]
    where: dict[str, tuple[int, _Row]]  # kernel id -> (group index, row)
    sizes: np.ndarray  # rows per group
    first_ids: np.ndarray  # each group's smallest id (wide enough for any id)
    columns: CandidateColumns  # the structural terms' inputs per group
    filter: _FilterColumns


def _passing(table: _Table, flt: Filters) -> np.ndarray:
    """Per group: does it pass `flt`?"""
    c = table.filter
    ok = table.columns.executable.copy() if flt.programs_only else np.ones(len(table.groups), dtype=bool)
    if flt.arch:
        ok &= c.arch.eq("any") | c.arch.eq(flt.arch)
    if flt.dtype:
        ok &= c.dtype.eq("") | c.dtype.eq(flt.dtype)
    if flt.head_dim:
        ok &= (c.head_dim == 0) | (c.head_dim == flt.head_dim)
    if flt.decode is not None:
        ok &= (table.columns.split_kv | table.columns.decode) == flt.decode
    if not flt.memory:
        ok &= ~c.generated
    ok &= table.columns.backward == flt.backward
    return ok


_TABLES: dict[str, _Table] = {}


def _marker(s: Session) -> tuple:
    """Changes whenever kernels are added or their ranking columns change (ids are content hashes)."""
    # verified cast: a sum typed Boolean comes back as True for any count (and PostgreSQL has no sum(boolean))
    stmt = select(func.count(), func.max(Kernel.created_at), func.sum(func.length(Kernel.features_json)),
                  func.sum(cast(Kernel.verified, Integer)), func.sum(func.length(Kernel.quarantine)))  # type: ignore[call-overload]
    return tuple(s.execute(stmt).one())


def _db_version(s: Session) -> tuple | None:
    """A cheap value that changes with every commit to the database, by any connection; None where there is none.

    SQLite: `PRAGMA data_version` counts other connections' commits, `total_changes()` this one's; both
    are per connection, hence the token stored with it. PostgreSQL: the WAL position (the replayed one on a
    standby), which every commit that changes a logged table advances; other databases of the cluster move it
    too, which only costs a marker scan (at 100k kernels ~90 ms, the reason for this gate).
    """
    conn = s.connection()
    if conn.dialect.name == "sqlite":
        token = conn.connection.info.setdefault("retrieve_token", object())
        return (token, conn.exec_driver_sql("PRAGMA data_version").scalar(),
                conn.exec_driver_sql("SELECT total_changes()").scalar())
    if conn.dialect.name == "postgresql":
        lsn = conn.exec_driver_sql("SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() "
                                   "ELSE pg_current_wal_lsn() END").scalar()
        return ("pg", str(lsn)) if lsn is not None else None
    return None


def _candidate_table(kb: KnowledgeBase) -> _Table:
    """The grouped candidate rows of `kb`, rebuilt only when the kernels table changed.

    The marker scans the kernels table; it is only recomputed after a commit (`_db_version`).
    """
    key = kb.settings.resolved_db_url
    cached = _TABLES.get(key)
    with kb.read_session() as s:
        seen = _db_version(s)
        if cached is not None and seen is not None and cached.seen == seen:
            return cached
        marker = _marker(s)
    if cached is None or cached.marker != marker:
        cached = _build_table(kb, marker)
    _TABLES[key] = cached = cached._replace(seen=seen)
    return cached


def _build_table(kb: KnowledgeBase, marker: tuple) -> _Table:
    rows = _candidates(kb)
    by_key: dict[tuple, list[_Row]] = {}
    for r in sorted(rows, key=lambda r: r.id):
        by_key.setdefault((r.features_json, r.verified, r.executable, r.arch, r.dtype, r.head_dim, r.origin), []).append(r)
    groups = [_Group(_features(fj), rs[0], rs) for (fj, *_), rs in by_key.items()]
    reps = [g.rep for g in groups]
    return _Table(
        marker, None, len(rows), groups,
        where={r.id: (gi, r) for gi, g in enumerate(groups) for r in g.rows},
        sizes=np.array([len(g.rows) for g in groups], dtype=np.int64),
        first_ids=np.array([g.rep.id for g in groups], dtype=f"U{max((len(r.id) for r in rows), default=1)}"),
        columns=candidate_columns([(g.features, g.rep.verified, g.rep.executable) for g in groups]),
        filter=_FilterColumns(
            arch=coded([r.arch for r in reps]), dtype=coded([r.dtype or "" for r in reps]),
            head_dim=np.array([r.head_dim or 0 for r in reps], dtype=np.int64),
            generated=np.array([r.origin == "generated" for r in reps], dtype=bool)),
    )


def _candidates(kb: KnowledgeBase) -> list[_Row]:
    prefix = func.substr(Kernel.ir_text, 1, len(PROGRAM_PREFIX)) == PROGRAM_PREFIX
    cols = (Kernel.id, Kernel.name, Kernel.family, Kernel.origin, Kernel.features_json, Kernel.arch,
            Kernel.dtype, Kernel.head_dim, Kernel.verified, prefix)
    with kb.read_session() as s:
        rows = [_Row._make((*r[:9], bool(r[9])))
                for r in s.execute(select(*cols).where(Kernel.quarantine == ""))]  # type: ignore[call-overload]
    bad = {r.features_json for r in rows if features_problems(r.features_json)}
    if bad:
        skipped = [r.id for r in rows if r.features_json in bad]
        log.warning("%d kernel(s) with malformed stored features are not candidates (%s); `kb doctor --fix` "
                    "quarantines them", len(skipped), ", ".join(skipped[:3]) + (" …" if len(skipped) > 3 else ""))
    return [r for r in rows if r.features_json not in bad]


@functools.lru_cache(maxsize=65536)
def _features(features_json: str) -> Features:
    return Features.from_json(features_json)


def _kernel_sims(kb: KnowledgeBase, table: _Table, vec: list[float]) -> dict[str, float]:
    """Similarity of the `EMBED_POOL` kernels nearest to `vec` that are in `table` (the others count 0)."""
    hits = kb.vectors.query("kernels", vec, min(EMBED_POOL, max(1, table.size)))
    stray = [h for h in hits if h[0] not in table.where]
    if stray:
        kb.hit_rows("kernels", stray)  # warns about drift (a kernel committed since the table was read has its row)
    return {kid: 1.0 - dist for kid, dist in hits if kid in table.where}


def _snippets(kb: KnowledgeBase, kinds: list[str], vec: list[float], per_kind: int) -> list[RankedSnippet]:
    hits = [h for kind in kinds for h in kb.vectors.query("snippets", vec, per_kind, {"kind": kind})]
    rows = [(sn, dist) for sn, dist in kb.hit_rows("snippets", hits) if isinstance(sn, Snippet)]  # all are: narrows the type
    return [RankedSnippet(sn.id, sn.kind, sn.title, sn.ir_text, _where(kb, sn), 1.0 - dist) for sn, dist in rows]


def _where(kb: KnowledgeBase, sn: Snippet) -> str:
    src = sn.source_id or "local"
    span = f":{sn.line_start}-{sn.line_end}" if sn.line_start else ""
    return f"{src} {sn.file}{span}"


def _lessons(kb: KnowledgeBase, qvec: list[float], target: Features | None, k: int = 5) -> list[str]:
    out = []
    for les, _ in kb.hit_rows("lessons", kb.vectors.query("lessons", qvec, k)):
        assert isinstance(les, Lesson)  # hit_rows reads the table it is named
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
