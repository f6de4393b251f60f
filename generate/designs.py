"""Which designs a generated kernel should run on a target GPU, from what the KB knows.

Three sources, in this order of trust:
1. **measured sweeps** (performance memory): `measured` perf records that name a design and an
   arch, grouped per (kernel, shape) into sweeps. A design's score for the target is the
   similarity-weighted mean, over sweeps on the same arch and head-dim bucket, of its speed
   relative to the best design of that sweep (0 where the sweep did not time it). Similarity
   counts the features that change which design wins (decode or prefill, the mask's block
   structure and how many keys a band lets a query see, the score_mod's cost, GQA, cross attention, dtype): `PERF_FEATURE_WEIGHTS`.
2. **expert tunables** lifted from the launch templates (FA2 per head dim for sm80/sm86, CUTLASS
   Hopper FMHA for sm90), mapped onto Triton launch parameters.
3. a small **default grid**, so a design search always has candidates.
Decode with GQA/MQA puts GQA-packed designs first (Design.pack_gqa: the query heads of a KV head share one
tile, so K/V are read once per KV head instead of Hq // Hkv times, as FA2's decode path, FA3's PackGQA and
FlashInfer's decode do) until the KB holds a measured packed design; then measurements decide.
`rank_designs` is a pure function of those inputs; `design_table` reads them from a KB, through
`KnowledgeBase.usable`: a stored record that breaks a rule (a design Triton cannot run, a shape that is not an
object of positive ints) is skipped with a warning, never fatal to generation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from kb.features import Features
from kb.ir.design import AUTO_SPLITS, Design, head_bucket
from kb.ir.nodes import Program, Store, walk_stmts
from kb.ir.text import parse_program
from kb.store import Kernel, PerfRecord, Tunable

__all__ = ["PERF_FEATURE_WEIGHTS", "LAYOUT_PENALTY", "Sweep", "perf_similarity", "expert_designs", "default_designs",
           "rank_designs", "sweeps_from_kb", "backward_structure", "structure_scores", "tunable_rows", "design_table", "TABLE_DEPTH",
           "STRUCTURE_MARGIN"]

TABLE_DEPTH = 4  # designs per (arch, bucket) in an emitted module: enough to survive a design that does not fit
_SCORE_COST = {"none": 0, "alibi": 1, "relative_bias": 1, "bias_table": 1, "softcap": 2, "custom": 2}
_MASK_CLASS = {"none": "none", "causal": "bounds", "sliding_window": "bounds", "prefix_lm": "table",
               "document": "table", "block_sparse": "table", "custom": "table"}
PERF_FEATURE_WEIGHTS = {"decode": 0.3, "mask": 0.15, "mask_class": 0.05, "span": 0.1, "score_cost": 0.15, "gqa": 0.1,
                        "cross": 0.1, "dtype": 0.05}
NARROW_SPAN = 128  # a band this narrow visits a couple of KV blocks per query tile: narrow tiles win (run 8a)


@dataclass(frozen=True)
class Sweep:
    """Designs of one kernel timed at one shape on one arch: design -> median ms."""

    kernel_id: str
    features: Features
    arch: str
    bucket: int
    times: tuple[tuple[Design, float], ...]
    case: tuple[str, str, str] = ("", "", "")  # (spec hash, shape, gpu): with `arch`, what else was timed alike
    structure: str = ""  # a backward kernel's dq structure (backward_structure); "" for a forward kernel

    def relative(self) -> dict[Design, float]:
        best = min(ms for _, ms in self.times)
        return {d: best / ms for d, ms in self.times}

    def best_ms(self) -> float:
        return min(ms for _, ms in self.times)


def _decode(f: Features) -> bool:
    return f.decode or f.split_kv


def _span_class(f: Features) -> str:
    return "unbounded" if not f.kv_span else "narrow" if f.kv_span <= NARROW_SPAN else "wide"


def backward_structure(p: Program) -> str:
    """How backward program `p` computes dq: "dq atomics" (FA2: the dK/dV kernel adds each tile's dq into an fp32
    buffer a last kernel converts) or "dq pass" (the AMD kernel's: a Q-outer kernel recomputes P for dq alone)."""
    q_shape = p.param("q").shape
    summed = {s.tensor for k in p.kernels for s in walk_stmts(k.body) if isinstance(s, Store) and s.accumulate}
    return "dq atomics" if any(p.param(t).shape == q_shape for t in summed) else "dq pass"


LAYOUT_PENALTY = 0.3  # a sweep of another memory layout counts exp(-8 * 0.3) = 0.09 as much (run 27)


def perf_similarity(a: Features, b: Features) -> float:
    """In [0, 1]: how alike two kernels are in what decides their best design. Kernels of different memory layouts
    (dense, a paged cache, packed varlen: `paged_kv`, `varlen`) are LAYOUT_PENALTY less alike: a page-table gather
    per lane changes which tile wins (run 27's paged tuning sweeps: the dense decode records' first design, 16x128 w4
    s3, 10% behind the paged decode's best, 16x64 w4 s2, at batch 128 x 16K), so a paged kernel's own sweeps lead
    where they exist and dense ones still vote where they do not; dense kernels compare as before."""
    w = PERF_FEATURE_WEIGHTS
    same = {"decode": _decode(a) == _decode(b), "mask": a.mask == b.mask,
            "mask_class": _MASK_CLASS.get(a.mask, "table") == _MASK_CLASS.get(b.mask, "table"),
            "score_cost": _SCORE_COST.get(a.score_mod, 2) == _SCORE_COST.get(b.score_mod, 2),
            "span": _span_class(a) == _span_class(b),
            "gqa": (a.gqa_ratio > 1) == (b.gqa_ratio > 1), "cross": a.cross == b.cross, "dtype": a.dtype == b.dtype}
    layout = (a.paged_kv, a.varlen) == (b.paged_kv, b.varlen)
    return max(0.0, sum(w[k] for k, ok in same.items() if ok) - (0.0 if layout else LAYOUT_PENALTY))


STRUCTURE_MARGIN = 0.03  # a structure leads only when measured this much faster: closer is the call-to-call spread


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def expert_designs(tunables: Iterable[tuple[str, int, dict]], arch: str, bucket: int, decode: bool,
                   backward: bool = False) -> list[Design]:
    """Designs from expert launch configurations `(arch, head_dim, params)` for this arch and head dim.

    Exact-arch configurations come first, then those of the other NVIDIA archs (FA2's sm80 choices
    are good starting points on Hopper too). Warps: the source's, else 8 for CUTLASS's two-consumer
    (cooperative / ping-pong) kernels, else 4; stages: the source's, else 3 on sm90 and 2 before.
    `backward`: the expert backward kernels' configurations only (and the reverse: a backward kernel's
    tiles say nothing about the forward's); stages: 1 where the source turns double buffering off, else 2;
    no tensor descriptors (the backward lowering does not use them)."""
    same: list[Design] = []
    other: list[Design] = []
    for t_arch, head_dim, params in tunables:
        if head_dim not in (0, bucket) or not t_arch.startswith("sm") or bool(params.get("split_kv")) != decode:
            continue
        if (params.get("direction") == "backward") != backward:
            continue
        bm, bn = _int(params.get("block_m")), _int(params.get("block_n"))
        if bm is None or bn is None:
            continue
        warps = _int(params.get("num_warps")) or (8 if any(w in str(params.get("kernel", "")) for w in ("Cooperative", "Pingpong")) else 4)
        stages = _int(params.get("num_stages")) or (3 if arch >= "sm90" and not backward else 2)
        if backward and params.get("no_double_buffer"):
            stages = 1
        try:
            d = Design(16 if decode else bm, bn, warps, stages, AUTO_SPLITS if decode else 1, tma=not backward)
        except Exception:
            continue
        (same if t_arch == arch else other).append(d)
    return list(dict.fromkeys(same + other))


# Packed decode is a bandwidth problem: each program streams its KV head's K/V once. 64-128 keys per tile and
# 3-4 stages keep 64-130 KB of K/V loads in flight per SM (~25 KB are needed to cover HBM latency at the
# H200's 4.8 TB/s over 132 SMs), and stay within 227 KB of shared memory at D = 128.
PACKED_DECODE_GRID = ((64, 4, 3), (128, 4, 3), (64, 4, 4), (128, 8, 3), (64, 2, 3), (128, 4, 2))


# Backward tiles (block_m queries x block_n keys): the KV-outer dK/dV kernel holds K, V, dK and dV tiles of block_n
# rows and streams block_m-row Q/dO tiles; narrow q tiles under wide kv tiles (32x128, 64x128) are what the Triton
# tutorial's and FA2's backwards use. The last four widen the search for `kb tune --backward`, and the dq_swap ones
# give a separate dq pass the transposed tile (the tutorial's BLOCK_M2 x BLOCK_N2 = 128 x 32 beside 32 x 128).
BACKWARD_GRID = ((64, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3), (32, 64, 4, 2), (128, 128, 8, 1),
                 (32, 128, 4, 2), (64, 128, 4, 3), (128, 128, 8, 2), (32, 128, 8, 3))
# (64, 128, 8, 3) swapped: FlexAttention's own backward tiles for D=128 on Hopper (BLOCK_M1=64, BLOCK_N1=128, the dQ
# pass transposed)
BACKWARD_SWAP_GRID = ((64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 2), (64, 128, 4, 3), (32, 128, 8, 3))
# (block_m, block_n, warps, stages, dq_swap) with the dK/dV kernel's query loop split by block class (Design.q_split):
# a hand-written copy of the causal D=128 dK/dV kernel ran fastest so (run 19, H100: 64x64 w4 s2 8.39 ms, 64x128 w8 s2
# 8.67, against 9.40 unsplit; at 3 stages 9.2-9.9); generated, the split won ALiBi D=128 and lost to windows and
# unions (run 19's tuning sweep), so sweeps decide per kernel
BACKWARD_QSPLIT_GRID = ((64, 64, 4, 2, False), (64, 128, 8, 2, True), (64, 128, 8, 2, False))


def default_designs(decode: bool, backward: bool = False) -> list[Design]:
    """The grid a design search always includes (Triton's usual attention tiles on NVIDIA GPUs); for decode,
    GQA-packed split-KV designs first (no-ops where a program or shape cannot pack); for the backward, narrower
    q tiles (its KV-outer loop holds K, V, dK and dV tiles at once) and no tensor descriptors."""
    if backward:
        return [Design(m, n, w, s, tma=False) for m, n, w, s in BACKWARD_GRID] \
            + [Design(m, n, w, s, tma=False, dq_swap=True) for m, n, w, s in BACKWARD_SWAP_GRID] \
            + [Design(m, n, w, s, tma=False, dq_swap=x, q_split=True) for m, n, w, s, x in BACKWARD_QSPLIT_GRID]
    if decode:
        return [Design(16, n, w, s, AUTO_SPLITS, pack_gqa=True) for n, w, s in PACKED_DECODE_GRID] \
            + [Design(16, n, w, s, AUTO_SPLITS) for n, w, s in ((64, 4, 2), (128, 4, 2), (64, 4, 3), (128, 8, 3),
                                                                 (256, 8, 2), (64, 2, 2))] \
            + [Design(16, 128, 4, 2, 16), Design(16, 64, 4, 2, 32)]
    grid = ((128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3),
            (128, 128, 8, 2), (128, 64, 4, 4), (64, 64, 4, 4), (128, 128, 4, 3), (64, 32, 4, 3))
    return [Design(m, n, w, s) for m, n, w, s in grid] + [Design(128, 128, 8, 3, tma=False), Design(128, 64, 4, 3, tma=False)]


NEAR = 0.25  # a sweep at least this fraction of the most alike sweep's weight is near: the near sweeps decide
# Backward designs listen to the most alike sweeps only: leave-one-spec-out over the 41 backward sweeps shipped by run
# 28 (`python -m bench.design_ranking`) puts the first timed pick at 0.955 / 0.959 / 0.961 / 0.963 of each sweep's best
# (geomean) for thresholds 0 / 0.25 / 0.5 / 0.8, min 0.730 -> 0.746, within 2% of the best 22 -> 24 of 41; forward
# stays at 0.25 (0.912 there, 0.908 at 0.8).
NEAR_BACKWARD = 0.8


def _ranked_by_sweeps(near: Sequence[tuple[Sweep, float]], near_frac: float = NEAR,
                      untimed_zero: bool = True) -> list[Design]:
    """Designs timed in the weighted sweeps, best first. The near sweeps (weight at least `near_frac` x the most alike
    one's; NEAR for forward designs, NEAR_BACKWARD for backward ones) decide: a design's score is the weighted mean
    over them of its time relative to each sweep's best (0 where a sweep did not time it); designs only farther
    sweeps timed follow, scored the same way over those. Chosen by
    leave-one-spec-out on the shipped sweeps (`python -m bench.design_ranking`, run 19, which also tries other
    `near_frac` and `untimed_zero=False`: a sweep that did not time a design says nothing about it): the first timed
    design within 0.934 (forward) and 0.962 (backward) of each held-out sweep's best, geomean, against 0.929 / 0.959
    with every sweep voting; averaging only over the sweeps that timed a design scored lower (0.928 / 0.941), and a
    threshold of 0.5 let one forward pick fall to 0.42."""
    if not near:
        return []
    top = max(w for _, w in near)
    ranked: list[Design] = []
    for tier in ([x for x in near if x[1] >= near_frac * top], [x for x in near if x[1] < near_frac * top]):
        num: dict[Design, float] = {}
        den: dict[Design, float] = {}
        for sweep, w in tier:
            for d, rel in sweep.relative().items():
                num[d] = num.get(d, 0.0) + w * rel
                den[d] = den.get(d, 0.0) + w
        total = sum(w for _, w in tier)
        scores = {d: num[d] / (total if untimed_zero else den[d]) for d in num}
        ranked += sorted((d for d in scores if d not in ranked), key=lambda d: (-scores[d], d))
    return ranked


def rank_designs(target: Features, arch: str, bucket: int, sweeps: Sequence[Sweep],
                 tunables: Iterable[tuple[str, int, dict]], *, memory: bool = True,
                 value_bucket: int | None = None, structure: str | None = None) -> list[Design]:
    """Every candidate design for `target` on `arch` at head-dim `bucket`, most promising first
    (`value_bucket`: the value head dim's bucket when v is wider or narrower than q/k; `structure`: a backward
    kernel's dq structure, whose sweeps alone rank its designs, as a learnable table's do)."""
    decode = _decode(target)
    measured: list[Design] = []
    if memory:
        near = [(s, math.exp(8.0 * (perf_similarity(target, s.features) - 1.0))) for s in sweeps
                if s.arch == arch and s.bucket == bucket and _decode(s.features) == decode
                and s.features.backward == target.backward
                # a learnable table's gradient adds atomics per tile: a frozen twin's best tile is not its best (run 16)
                and (not target.backward or s.features.learned_table == target.learned_table)
                and (structure is None or s.structure == structure)]
        measured = _ranked_by_sweeps(near, NEAR_BACKWARD if target.backward else NEAR)
    ranked = measured + expert_designs(tunables, arch, bucket, decode, target.backward) \
        + default_designs(decode, target.backward)
    if decode and target.gqa_ratio != 1 and not any(d.pack_gqa for d in measured):
        # packing not measured yet: the expert practice (packed, bandwidth-sized tiles) before unpacked measurements
        packed = [d for d in ranked if d.pack_gqa]  # the default grid's packed designs (nothing measured packs)
        ranked = packed + [replace(d, pack_gqa=True) for d in measured + expert_designs(tunables, arch, bucket, decode)] + ranked
    # tiles that cannot fit shared memory: never
    return [d for d in dict.fromkeys(ranked) if d.fits(arch, bucket, head_dim_v=value_bucket)]


# ---- reading the KB --------------------------------------------------------------------------

def sweeps_from_kb(kb, arch: str | None = None) -> list[Sweep]:
    """Measured designs grouped per (kernel, shape, arch, gpu): the performance memory."""
    rows = [r for r in kb.usable(PerfRecord, kind="measured") if r.arch and r.design_json not in ("", "{}")
            and "impl" not in json.loads(r.design_json) and (arch is None or r.arch == arch) and r.ms]  # not .cu records
    groups: dict[tuple[str, str, str, str], list] = {}
    for r in rows:
        groups.setdefault((r.kernel_id, r.shape_json, r.arch, r.gpu), []).append(r)
    out = []
    structures: dict[str, str] = {}
    for (kid, shape_json, rec_arch, _), recs in sorted(groups.items()):
        kernel = kb.find(kid)
        if not isinstance(kernel, Kernel) or not kb.skip_unusable([kernel]):
            continue
        d = json.loads(shape_json).get("D") or kernel.head_dim or 128
        times = {Design.from_dict(json.loads(r.design_json)): r.ms for r in recs}
        features = Features.from_json(kernel.features_json)
        if features.backward and kid not in structures:
            structures[kid] = backward_structure(parse_program(kernel.ir_text))
        out.append(Sweep(kid, features, rec_arch, head_bucket(int(d)), tuple(sorted(times.items())),
                         (kernel.spec_hash, shape_json, recs[0].gpu), structures.get(kid, "")))
    return out


def structure_scores(sweeps: Sequence[Sweep], target: Features) -> dict[str, float]:
    """How fast each backward structure ran for kernels like `target`: the similarity-weighted mean, over cases where
    one spec was timed at one shape on one GPU with two or more structures, of the structure's best time relative to
    the fastest structure's (1.0: it won). Empty when nothing was compared: retrieval's order stands."""
    cases: dict[tuple[str, ...], dict[str, tuple[float, Features]]] = {}
    for s in sweeps:
        kind = s.structure
        if not kind or not s.case[0] or s.features.learned_table != target.learned_table:
            continue  # a learnable table's gradient changes which structure wins (as it changes the best tile)
        best = cases.setdefault((*s.case, s.arch), {})
        if kind not in best or s.best_ms() < best[kind][0]:
            best[kind] = (s.best_ms(), s.features)
    total: dict[str, float] = {}
    weight: dict[str, float] = {}
    for by_kind in cases.values():
        if len(by_kind) < 2:
            continue
        fastest = min(ms for ms, _ in by_kind.values())
        for kind, (ms, feats) in by_kind.items():
            w = math.exp(8.0 * (perf_similarity(target, feats) - 1.0))
            total[kind] = total.get(kind, 0.0) + w * fastest / ms
            weight[kind] = weight.get(kind, 0.0) + w
    return {k: total[k] / weight[k] for k in total}


def tunable_rows(kb) -> list[tuple[str, int, dict]]:
    """Every expert tunable of the KB as (arch, head dim or 0, launch parameters)."""
    return [(t.arch, t.head_dim or 0, json.loads(t.params_json)) for t in kb.usable(Tunable)]


def design_table(kb, target: Features, archs: Sequence[str], buckets: Sequence[int], *,
                 memory: bool = True, depth: int = TABLE_DEPTH, value_bucket: int | None = None,
                 structure: str | None = None) -> dict[str, dict[int, tuple[Design, ...]]]:
    """{arch: {bucket: the top `depth` designs}} for an emitted module (`value_bucket`, `structure`: see
    rank_designs)."""
    sweeps = sweeps_from_kb(kb) if memory else []
    tunables = tunable_rows(kb)
    return {arch: {b: tuple(rank_designs(target, arch, b, sweeps, tunables, memory=memory,
                                         value_bucket=value_bucket, structure=structure)[:depth]) for b in buckets}
            for arch in archs}
