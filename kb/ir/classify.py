"""Classify variant expressions into mask and score kinds, and derive features.

`classify_mask` and `classify_score` decide what a `mask_mod` / `score_mod` *means*, robust
to how it is written:
- a mask is split into its top-level `&` terms; the terms without loads are conjoined and
  evaluated on an index grid, then fitted to canonical forms (a diagonal band
  `lo <= kv_idx - q_idx <= hi`, which covers top-left and bottom-right causal and sliding
  windows, or a band widened by a prefix of always-visible keys = prefix-LM);
- terms with loads are matched structurally (the same tensor loaded at q_idx and at kv_idx
  and compared for equality = document mask; a tensor loaded at `q_idx // c, kv_idx // c`
  = block-sparse; `kv_idx < prefix[b]` or-ed with a causal term = prefix-LM);
- a score_mod is split into additive terms: exactly one term uses `score` (plain, or
  softcapped `c * tanh(x / c)`, checked numerically), the others are biases: a per-head
  factor times a linear function of `kv_idx - q_idx` = ALiBi, loads indexed by
  shift-invariant positions (`q_idx - kv_idx + c`) = relative bias, loads indexed by q_idx
  and kv_idx separately = bias table.

Invariants: classification never raises on a well-formed expression; anything not
recognised is kind "custom" (with the flags that were recognised still set). Grid
evaluation uses the caller's (M, N) when given, since traced expressions carry concrete
shape constants (e.g. `q_idx + 64 >= kv_idx` is bottom-right causal only when N - M == 64).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from kb.features import Features
from kb.ir.evaluate import eval_expr
from kb.ir.algebra import conjuncts, disjuncts
from kb.ir.expr import Expr, ExprOp, call, const, free_vars, loaded_tensors, number, var, walk

__all__ = [
    "MaskClass",
    "ScoreClass",
    "classify_mask",
    "classify_score",
    "mask_kv_bounds",
    "features_from_variants",
    "Band",
    "fit_band",
    "DEFAULT_GRID",
]

DEFAULT_GRID = (64, 64)  # (M, N) used when the caller gives no shapes
_POS_VARS = frozenset({"q_idx", "kv_idx", "M", "N"})
_HEAD_VARS = frozenset({"h", "Hq", "Hkv", "H"})
# priority when several mask kinds are present at once (the first wins)
_MASK_PRIORITY = ("block_sparse", "document", "prefix_lm", "sliding_window", "causal")
_SCORE_PRIORITY = ("alibi", "relative_bias", "bias_table", "softcap")


@dataclass(frozen=True)
class MaskClass:
    """What a mask_mod means.

    The band is `band_lo <= kv_idx - q_idx <= band_hi` (None = unbounded on this grid), in
    FlashAttention terms window_left = -band_lo, window_right = band_hi. `bottom_right`
    says band_hi equals N - M (causal aligned to the last query), so bounds use `N - M`.
    """

    kind: str = "none"
    causal: bool = False
    bottom_right: bool = False
    band_lo: int | None = None
    band_hi: int | None = None
    prefix: int | None = None  # constant prefix length of a prefix-LM mask
    tensors: tuple[str, ...] = ()  # aux tensors the mask loads (doc ids, block masks, prefix lengths)

    @property
    def window_left(self) -> int | None:
        return None if self.band_lo is None else -self.band_lo

    @property
    def window_right(self) -> int | None:
        return self.band_hi


@dataclass(frozen=True)
class ScoreClass:
    kind: str = "none"
    alibi: bool = False
    softcap: float | None = None
    relative: bool = False
    bias_table: bool = False
    tensors: tuple[str, ...] = ()


# ---------------------------------------------------------------- helpers


def _has_load(e: Expr) -> bool:
    return any(n.op is ExprOp.LOAD for n in walk(e))


def _grid(M: int, N: int) -> dict[str, torch.Tensor | int]:
    return {"q_idx": torch.arange(M).view(M, 1), "kv_idx": torch.arange(N).view(1, N), "M": M, "N": N}


def _grid_for(e: Expr, M: int, N: int) -> dict[str, torch.Tensor | int]:
    """_grid plus a probe value for the other sizes `e` reads (Hq, a table's size `rel_n1`): constants along the
    positions, so they do not change what depends on q_idx and kv_idx."""
    env = _grid(M, N)
    sizes = {v for v in free_vars(e) if v in ("B", "Hq", "Hkv", "D", "Dv") or re.fullmatch(r"\w+_n\d+", v)}
    return {**env, **{v: 97 for v in sizes - set(env)}}


def _eval_bool(e: Expr, M: int, N: int) -> torch.Tensor | None:
    try:
        val = eval_expr(e, _grid(M, N))
    except Exception:
        return None
    t = torch.as_tensor(val)
    return t.bool().expand(M, N) if t.dim() <= 2 else None


def _configs(e: Expr, dims: tuple[int, int] | None) -> list[tuple[int, int]]:
    first = dims or DEFAULT_GRID
    # symbolic M/N in the expression: also probe unequal shapes to tell alignments apart
    return [first, (40, 64), (64, 40)] if free_vars(e) & {"M", "N"} else [first]


@dataclass(frozen=True)
class Band:
    """`lo <= kv_idx - q_idx <= hi` (None = unbounded), or-ed with `kv_idx < prefix`."""

    lo: int | None
    hi: int | None
    prefix: int | None


def fit_band(g: torch.Tensor) -> Band | None:
    """Fit a boolean [M, N] grid `g[q, kv]` to `lo <= kv - q <= hi`, optionally or-ed with `kv < prefix`."""
    M, N = g.shape
    d = torch.arange(N).view(1, N) - torch.arange(M).view(M, 1)
    if bool(g.all()):
        return Band(None, None, None)
    plain = _fit_with_prefix(g, d, 0)
    if plain is not None:
        return plain
    prefix = 0
    while prefix < N and bool(g[:, prefix].all()):
        prefix += 1
    return _fit_with_prefix(g, d, prefix) if prefix else None


def _fit_with_prefix(g: torch.Tensor, d: torch.Tensor, prefix: int) -> Band | None:
    M, N = g.shape
    rest = g[:, prefix:]
    dr = d[:, prefix:]
    if not bool(rest.any()):
        return None
    lo, hi = int(dr[rest].min()), int(dr[rest].max())
    band = (d >= lo) & (d <= hi)
    cols = torch.arange(N).view(1, N) < prefix
    if not torch.equal(band | cols, g):
        return None
    lo_b = None if lo <= int(dr.min()) else lo
    hi_b = None if hi >= int(dr.max()) else hi
    if prefix and lo_b is not None:
        return None  # a window plus a prefix: not a canonical form
    return Band(lo_b, hi_b, prefix or None)


# ---------------------------------------------------------------- masks


def _doc_term(t: Expr) -> str | None:
    """`doc[.., q_idx ..] == doc[.., kv_idx ..]` -> 'doc'."""
    if t.op is not ExprOp.EQ:
        return None
    a, b = t.args
    if a.op is not ExprOp.LOAD or b.op is not ExprOp.LOAD or a.value != b.value:
        return None
    fa, fb = free_vars(a), free_vars(b)
    sides = {("q_idx" in fa and "kv_idx" not in fa), ("kv_idx" in fb and "q_idx" not in fb)}
    sides_swapped = {("kv_idx" in fa and "q_idx" not in fa), ("q_idx" in fb and "kv_idx" not in fb)}
    return str(a.value) if sides == {True} or sides_swapped == {True} else None


def _block_sparse_term(t: Expr) -> str | None:
    """A bool tensor loaded at (.., q_idx // BM, kv_idx // BN), maybe compared with 0/1."""
    if t.op in (ExprOp.NE, ExprOp.EQ, ExprOp.GT) and t.args[1].op is ExprOp.CONST:
        t = t.args[0]
    if t.op is not ExprOp.LOAD:
        return None
    divs = [a for a in t.args if a.op is ExprOp.FLOORDIV and a.args[1].op is ExprOp.CONST]
    uses = [free_vars(a) for a in divs]
    if any("q_idx" in u for u in uses) and any("kv_idx" in u for u in uses):
        return str(t.value)
    return None


def _prefix_load_term(t: Expr) -> str | None:
    """`kv_idx < prefix[b]` (or `prefix[b] > kv_idx`)."""
    if t.op is ExprOp.LT and t.args[0] == var("kv_idx") and t.args[1].op is ExprOp.LOAD:
        return str(t.args[1].value)
    if t.op is ExprOp.GT and t.args[1] == var("kv_idx") and t.args[0].op is ExprOp.LOAD:
        return str(t.args[0].value)
    return None


def _band_of(e: Expr, dims: tuple[int, int] | None) -> tuple[Band, bool] | None:
    """Fit a load-free boolean expression of positions; returns (band, bottom_right)."""
    if not free_vars(e) <= _POS_VARS:
        return None
    fits: list[tuple[Band, int, int]] = []
    for M, N in _configs(e, dims):
        g = _eval_bool(e, M, N)
        if g is None:
            return None
        band = fit_band(g)
        if band is None:
            return None
        fits.append((band, M, N))
    band, M0, N0 = fits[0]
    # bottom-right: hi == N - M on every probed shape (and it differs from top-left somewhere)
    bottom_right = band.hi is not None and all(b.hi == n - m for b, m, n in fits) and any(n != m for _, m, n in fits)
    if not bottom_right and len({(b.lo, b.hi, b.prefix) for b, _, _ in fits}) > 1:
        return None
    return band, bottom_right


def classify_mask(expr: Expr | None, dims: tuple[int, int] | None = None) -> MaskClass:
    """Classify a mask_mod; `dims` = (M, N) of the spec when known."""
    if expr is None:
        return MaskClass()
    free: list[Expr] = []
    loaded: list[Expr] = []
    for t in conjuncts(expr):
        (loaded if _has_load(t) else free).append(t)
    kinds: set[str] = set()
    tensors: list[str] = []
    band, bottom_right = Band(None, None, None), False
    if free:
        conj = free[0]
        for t in free[1:]:
            conj = conj & t
        fitted = _band_of(conj, dims)
        if fitted is None:
            kinds.add("custom")
        else:
            band, bottom_right = fitted
    for t in loaded:
        name = _doc_term(t) or None
        if name:
            kinds.add("document")
            tensors.append(name)
            continue
        name = _block_sparse_term(t)
        if name:
            kinds.add("block_sparse")
            tensors.append(name)
            continue
        parts = disjuncts(t)
        pre = [p for p in parts if _prefix_load_term(p)]
        others = [p for p in parts if not _prefix_load_term(p)]
        if len(pre) == 1 and len(others) == 1 and not _has_load(others[0]):
            sub = _band_of(others[0], dims)
            if sub is not None and sub[0].lo is None and sub[0].hi is not None:
                kinds.add("prefix_lm")
                tensors.append(_prefix_load_term(pre[0]) or "")
                band, bottom_right = Band(band.lo, sub[0].hi if band.hi is None else min(band.hi, sub[0].hi), None), sub[1]
                continue
        kinds.add("custom")
        tensors.extend(sorted(loaded_tensors(t)))
    causal = band.lo is None and band.hi is not None and (band.hi == 0 or bottom_right)
    if band.prefix is not None:
        kinds.add("prefix_lm")
        causal = band.hi is not None and (band.hi == 0 or bottom_right)
    elif band.lo is not None or (band.hi is not None and not causal):
        kinds.add("sliding_window")
        causal = band.hi is not None and (band.hi == 0 or bottom_right)
    elif causal:
        kinds.add("causal")
    kind = "custom" if "custom" in kinds else next((k for k in _MASK_PRIORITY if k in kinds), "none")
    return MaskClass(
        kind=kind, causal=causal, bottom_right=bottom_right, band_lo=band.lo, band_hi=band.hi,
        prefix=band.prefix, tensors=tuple(dict.fromkeys(tensors)),
    )


def mask_kv_bounds(expr: Expr | None, dims: tuple[int, int] | None = None) -> tuple[Expr, Expr] | None:
    """KV range [lo, hi) a query block `[m_start, m_start + BLOCK_M)` must visit.

    Expressions over `m_start`, `BLOCK_M`, `M`, `N`; None when the mask has no diagonal
    band (no mask, prefix-LM, custom). Keys outside the range are masked for every row of
    the block, so skipping them is exact; keys inside still need the element mask.
    """
    if expr is None:
        return None
    mc = classify_mask(expr, dims)
    if mc.prefix is not None or "prefix_lm" == mc.kind or (mc.band_lo is None and mc.band_hi is None):
        return None
    if mc.kind == "custom":
        return None
    M0, N0 = dims or DEFAULT_GRID
    m_start, block_m, M, N = var("m_start"), var("BLOCK_M"), var("M"), var("N")
    shift = N - M if mc.bottom_right else None

    def offset(base: Expr, k: int) -> Expr:
        if shift is not None:
            base = base + shift
            k -= N0 - M0
        return base if k == 0 else base + k if k > 0 else base - abs(k)

    hi = N if mc.band_hi is None else call("minimum", N, offset(m_start + block_m, mc.band_hi))

    lo = const(0) if mc.band_lo is None else call("maximum", const(0), offset(m_start, mc.band_lo))
    return lo, hi


# ---------------------------------------------------------------- scores


def _add_terms(e: Expr, sign: int = 1) -> list[tuple[int, Expr]]:
    if e.op is ExprOp.ADD:
        return _add_terms(e.args[0], sign) + _add_terms(e.args[1], sign)
    if e.op is ExprOp.SUB:
        return _add_terms(e.args[0], sign) + _add_terms(e.args[1], -sign)
    return [(sign, e)]


def _mul_factors(e: Expr) -> list[Expr]:
    if e.op is ExprOp.MUL:
        return _mul_factors(e.args[0]) + _mul_factors(e.args[1])
    if e.op is ExprOp.NEG:
        return [const(-1)] + _mul_factors(e.args[0])
    return [e]


def _softcap_value(e: Expr) -> float | None:
    """c if `e(score) == c * tanh(score / c)` numerically (e depends on score only)."""
    if free_vars(e) != {"score"} or _has_load(e) or not any(n.op is ExprOp.TANH for n in walk(e)):
        return None
    s = torch.linspace(-60.0, 60.0, 241, dtype=torch.float64)
    try:
        big = float(torch.as_tensor(eval_expr(e, {"score": torch.tensor(1e6, dtype=torch.float64)})))
        vals = torch.as_tensor(eval_expr(e, {"score": s}), dtype=torch.float64)
    except Exception:
        return None
    if not math.isfinite(big) or big <= 0:
        return None
    ok = torch.allclose(vals, big * torch.tanh(s / big), rtol=1e-6, atol=1e-6)
    return big if ok else None


def _shift_invariant(e: Expr, dims: tuple[int, int] | None) -> bool:
    M, N = dims or DEFAULT_GRID
    env = _grid_for(e, M, N)
    try:
        a = torch.as_tensor(eval_expr(e, env))
        b = torch.as_tensor(eval_expr(e, {**env, "q_idx": env["q_idx"] + 1, "kv_idx": env["kv_idx"] + 1}))
    except Exception:
        return False
    return bool(torch.equal(a.expand(M, N), b.expand(M, N)))


def _linear_in_distance(e: Expr, dims: tuple[int, int] | None) -> bool:
    """e(q, kv) == a * (kv - q) + c or a * |kv - q| + c, with a != 0."""
    M, N = dims or DEFAULT_GRID
    try:
        val = torch.as_tensor(eval_expr(e, _grid_for(e, M, N)), dtype=torch.float64).expand(M, N)
    except Exception:
        return False
    d = (torch.arange(N).view(1, N) - torch.arange(M).view(M, 1)).double()
    for feat in (d, d.abs()):
        x = torch.stack([feat.flatten(), torch.ones(M * N, dtype=torch.float64)], 1)
        sol = torch.linalg.lstsq(x, val.flatten().unsqueeze(1)).solution
        if abs(float(sol[0])) > 1e-9 and torch.allclose(x @ sol, val.flatten().unsqueeze(1), atol=1e-6):
            return True
    return False


def _bias_kind(t: Expr, dims: tuple[int, int] | None) -> str:
    """Kind of an additive bias term (no `score` inside)."""
    fv = free_vars(t)
    if not fv & {"q_idx", "kv_idx"}:
        return "custom"
    factors = _mul_factors(t)
    head = [f for f in factors if not free_vars(f) & _POS_VARS and f.op is not ExprOp.CONST]
    pos = [f for f in factors if free_vars(f) & _POS_VARS]
    if head and len(pos) == 1 and not _has_load(pos[0]) and all(free_vars(f) <= _HEAD_VARS for f in head):
        if _linear_in_distance(pos[0], dims):
            return "alibi"
    if not _has_load(t):
        return "relative_bias" if _shift_invariant(t, dims) else "custom"
    return _load_bias_kind(t, dims)


def _load_bias_kind(t: Expr, dims: tuple[int, int] | None) -> str:
    """relative_bias if every position-dependent load-free part is shift invariant."""
    table = False

    def visit(n: Expr) -> bool:
        nonlocal table
        if not free_vars(n) & {"q_idx", "kv_idx"}:
            return True
        if not _has_load(n):
            if _shift_invariant(n, dims):
                return True
            table = True
            return n.op is ExprOp.VAR  # a bare q_idx / kv_idx index: a full table
        if n.op is ExprOp.LOAD:
            return all(visit(a) for a in n.args)
        return all(visit(a) for a in n.args)

    ok = visit(t)
    if table and ok:
        return "bias_table"
    return "relative_bias" if ok else "custom"


def classify_score(expr: Expr | None, dims: tuple[int, int] | None = None) -> ScoreClass:
    """Classify a score_mod (applied to the already scaled score)."""
    if expr is None or expr == var("score"):
        return ScoreClass()
    kinds: set[str] = set()
    cap: float | None = None
    terms = _add_terms(expr)
    score_terms = [(s, t) for s, t in terms if "score" in free_vars(t)]
    bias_terms = [t for s, t in terms if "score" not in free_vars(t)]
    if len(score_terms) != 1 or score_terms[0][0] != 1:
        return ScoreClass(kind="custom", tensors=tuple(sorted(loaded_tensors(expr))))
    st = score_terms[0][1]
    if st != var("score"):
        cap = _softcap_value(st)
        if cap is None:
            inner = _softcap_inner(st)
            if inner is None:
                return ScoreClass(kind="custom", tensors=tuple(sorted(loaded_tensors(expr))))
            sub = classify_score(inner[1], dims)
            cap, kinds = inner[0], {sub.kind} - {"none"} if sub.kind != "custom" else {"custom"}
            kinds |= {k for k, f in (("alibi", sub.alibi), ("relative_bias", sub.relative), ("bias_table", sub.bias_table)) if f}
        kinds.add("softcap")
    for t in bias_terms:
        kinds.add(_bias_kind(t, dims))
    kind = "custom" if "custom" in kinds else next((k for k in _SCORE_PRIORITY if k in kinds), "none")
    return ScoreClass(
        kind=kind, alibi="alibi" in kinds, softcap=cap, relative="relative_bias" in kinds,
        bias_table="bias_table" in kinds, tensors=tuple(sorted(loaded_tensors(expr))),
    )


def _softcap_inner(e: Expr) -> tuple[float, Expr] | None:
    """`c * tanh(x / c)` with x a biased score -> (c, x)."""
    factors = _mul_factors(e)
    consts = [f for f in factors if f.op is ExprOp.CONST]
    tanhs = [f for f in factors if f.op is ExprOp.TANH]
    if len(consts) != 1 or len(tanhs) != 1 or len(factors) != 2:
        return None
    c = float(number(consts[0]))
    x = tanhs[0].args[0]
    if x.op is ExprOp.DIV and x.args[1].op is ExprOp.CONST and math.isclose(float(number(x.args[1])), c, rel_tol=1e-6):
        return c, x.args[0]
    if x.op is ExprOp.MUL and x.args[1].op is ExprOp.CONST and math.isclose(float(number(x.args[1])) * c, 1.0, rel_tol=1e-6):
        return c, x.args[0]
    return None


# ---------------------------------------------------------------- features


def features_from_variants(
    score_mod: Expr | None,
    mask_mod: Expr | None,
    *,
    head_dim: int,
    dtype: str,
    gqa_ratio: int = 1,
    seq_q: int | None = None,
    seq_kv: int | None = None,
    dropout: bool = False,
    return_lse: bool = False,
    paged_kv: bool = False,
    varlen: bool = False,
    split_kv: bool | None = None,
    arch: str = "any",
    sinks: bool = False,
) -> Features:
    """The one feature vector for variant expressions plus shape facts.

    decode = seq_q <= 16 and seq_kv >= 8 * seq_q; split_kv defaults to decode;
    cross = seq_q != seq_kv and not decode.
    """
    dims = (seq_q, seq_kv) if seq_q and seq_kv else None
    mc = classify_mask(mask_mod, dims)
    sc = classify_score(score_mod, dims)
    decode = bool(seq_q and seq_kv and seq_q <= 16 and seq_kv >= 8 * seq_q)
    cross = bool(seq_q and seq_kv and seq_q != seq_kv and not decode)
    return Features(
        mask=mc.kind,
        causal=mc.causal,
        sliding_window=mc.kind == "sliding_window" or mc.band_lo is not None,
        score_mod=sc.kind,
        alibi=sc.alibi,
        softcap=sc.softcap is not None,
        gqa_ratio=gqa_ratio,
        head_dim=head_dim,
        dtype=dtype,
        split_kv=decode if split_kv is None else split_kv,
        decode=decode,
        paged_kv=paged_kv,
        varlen=varlen,
        dropout=dropout,
        return_lse=return_lse,
        cross=cross,
        kv_span=_kv_span(mc),
        arch=arch,
        sinks=sinks,
    )


def _kv_span(mc: MaskClass) -> int:
    """Keys per query under a constant two-sided band (a sliding window, a local band); 0 when unbounded."""
    if mc.band_lo is None or mc.band_hi is None or mc.bottom_right:
        return 0
    return mc.band_hi - mc.band_lo + 1
