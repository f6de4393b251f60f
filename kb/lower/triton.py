"""Program -> Triton source: one `@triton.jit` function per IR kernel plus a host `forward`.

Reference-guided: the statement structure of the Program decides the code shape. Each IR
statement becomes a few lines in the FlashAttention-2 Triton forward style (q tile in
registers, K/V streamed by the `for` loop with the IR's exact bounds, `tl.dot` with fp32
accumulation, `p` cast to v's dtype before the second dot, exp2 with log2(e) folded into
one multiply-add).

Invariants of the generated module:
- It is standalone (imports only math, os, torch, triton) and importable from a file.
- Every tensor gets explicit strides, so non-contiguous inputs work; every tile load/store
  is masked by the extents of the dims it spans (ragged lengths, HEAD_PAD > D).
- The online-softmax state keeps the IR's natural-log meaning (`m` is the natural row
  max); only the exponentials use exp2 on `x * log2(e) - m * log2(e)` (one FMA, as FA2).
- Fully masked rows never produce NaN: the max used in the exponent is 0 while the row
  max is -inf, `finalize` divides by 1 where l == 0 and gives lse = -inf there.
- `if block(...) is CLASS` is decided in closed form on (q_start, kv_start) when the
  mask_mod is an `|` of conjunctions of bounds, each on one linear form in q_idx/kv_idx with
  unit coefficients (causal, sliding window, offsets; prefix-LM with a constant, 0-d or
  per-batch prefix, whose bounds load `prefix[b]` once per program); otherwise the module's
  `_block_class_kernel` fills a block-class table [B|1, H|1, n_m_blocks, n_n_blocks] int8 on
  the GPU (one program per tile), kept while the mask's inputs are unchanged.
  Table codes: 0 empty, 1 partial, 2 full; an unaligned tile start reads as partial.
  From it the host also builds per-row lists of partial and of full blocks, which a KV loop
  over such a mask iterates instead of every block (LowerOptions.indexed_kv_loop).
- Loads in mask_mod / score_mod that do not move along the KV loop (`doc[b, q_idx]`, `prefix[b]`,
  `slopes[h]`) are loaded once before the outermost loop.
- The IR's HEAD_PAD=0 means max(16, next_pow2(D)) here (`tl.dot` needs K >= 16 on GPUs;
  the extra columns are zero-padded and masked, so results do not change); a program with a
  value head dim `Dv` (kb.ir.value_dim) also gets HEAD_PAD_V = max(16, next_pow2(Dv)) and
  EVEN_DV, which only such programs receive.
"""

from __future__ import annotations

import dataclasses
import keyword
import re
from dataclasses import dataclass, field
from enum import Enum

from kb.errors import KBError
from kb.ir.design import Design, DesignTable
from kb.ir.algebra import FLIP, all_of, any_of, conjuncts, disjuncts, linear_form, max_of, min_of, next_pow2, tidy_int
from kb.ir.expr import Expr, ExprOp, call, const, free_vars, load, loaded_tensors, substitute, var, walk
from kb.ir.nodes import (
    DOT_MIN_K, AuxGrad, BlockClass, Combine, Dot, Dtype, Elementwise, Finalize, For, Full, IfBlock, Init, Kernel, Let,
    Load, Mask, OnlineSoftmax, Param, Probs, Program, Reduce, Role, SCHEDULE_CONSTANTS, ScoreMod, ScoreModGrad,
    SoftmaxGrad, Span, Stmt, Store, TileAt, VALUE_DIM, is_backward, launch_constants, serving_constructs, walk_stmts,
)
from kb.ir.visit import StmtVisitor
from kb.lower.pack_gqa import PACK_ROWS, PackPlan, pack_plans, row_span
from kb.lower.triton_expr import AuxRef, ExprContext, ExprTarget, Kind, Sym, expr_kind, is_nonneg, lower_expr

__all__ = ["lower_program", "LowerOptions", "BlockMaskKind", "BlockMaskPlan", "plan_block_mask", "kernel_fn_name", "EMPTY", "PARTIAL", "FULL",
           "CLASS_CODE", "HostEntry", "program_signature", "kernel_sources", "check_attention_params"]

EMPTY, PARTIAL, FULL = 0, 1, 2
CLASS_CODE = {BlockClass.EMPTY: EMPTY, BlockClass.PARTIAL: PARTIAL, BlockClass.FULL: FULL}  # host-table codes
_LOG2E = "1.4426950408889634"
_NEG_INF = 'float("-inf")'
_TL_DTYPE = {Dtype.F32: "tl.float32", Dtype.BF16: "tl.bfloat16", Dtype.F16: "tl.float16",
             Dtype.I32: "tl.int32", Dtype.I64: "tl.int64", Dtype.BOOL: "tl.int1"}
_TORCH_DTYPE = {Dtype.F32: "torch.float32", Dtype.BF16: "torch.bfloat16", Dtype.F16: "torch.float16",
                Dtype.I32: "torch.int32", Dtype.I64: "torch.int64", Dtype.BOOL: "torch.bool"}
_KIND = {Dtype.F32: Kind.FLOAT, Dtype.BF16: Kind.FLOAT, Dtype.F16: Kind.FLOAT,
         Dtype.I32: Kind.INT, Dtype.I64: Kind.INT, Dtype.BOOL: Kind.BOOL}
_RESERVED = {"tl", "triton", "torch", "math", "os", "range", "float", "int", "max", "min", "pid", "dims", "grid"}


@dataclass(frozen=True)
class LowerOptions:
    """Speed transformations of the lowering; each keeps the IR's semantics exactly.

    - split_kv_loop: a forward KV loop whose masks/block-class tests all concern the loop's own
      (BLOCK_M x BLOCK_N) tile, under a closed-form plan (no mask, or bounds on q_idx - kv_idx),
      becomes three loops: partial blocks, full blocks (no mask code, unmasked K/V loads), partial
      blocks. Full blocks form one interval of kv_start, computed in closed form per program.
    - fold_scale: `s = s * c` (c a positive scalar param, checked on the host) followed only by
      masks and online_softmax is folded into the softmax's exp2 argument (one FMA per score).
    - even_headdim: loads/stores over the head dim drop the `< D` mask when D == HEAD_PAD (constexpr), and
      those over the value head dim the `< Dv` mask when Dv == HEAD_PAD_V (EVEN_DV).
    - heavy_first: grids whose last axis moves the KV loop bound (causal-like) run that axis in
      reverse, so the longest programs start first and the tail of the launch is short.
    - tma (Hopper fast path): 2-D tile loads (fill 0) and stores of float tensors
      `t[e0, .., Span|Full, Span|Full]` also get a tensor-descriptor form
      (`tl.make_tensor_descriptor` over the [rows, cols] slice at the leading indices, so Triton
      uses the TMA copy engine and zero-fills / clips out-of-range rows and columns exactly as the
      masked form does). The host picks the form at launch (USE_TMA constexpr): only on a CUDA
      device of compute capability >= 9.0, not interpreting, with every such tensor's last dim
      contiguous, its base and other strides 16-byte aligned, and tile sides <= 256. Descriptors
      of loads inside a loop are built once before the outermost loop when their leading indices
      do not change in it. Measured on H200 (causal/plain D=128 S=8K, bench/results/hopper_h200.json):
      +5% / +10% at 128x128 w8 s3; at 128x64 it is no faster.
    - warp_specialize (off by default): with USE_TMA and the schedule's `warp_specialize` hint,
      innermost forward loops become `tl.range(..., warp_specialize=True)` (WARP_SPEC constexpr).
      Triton 3.6 on H200 gave no gain (w8) and failed to compile at num_warps=4 (NVGPUWarpSpecialization).
    - pack_gqa: kernels that pass `kb.lower.pack_gqa.pack_plans` also get a packed form (`_<name>_packed_kernel`):
      the query heads of one KV head become tile rows, so K/V are read once per KV head and split instead of
      Hq // Hkv times. The host runs it when the design asks (Design.pack_gqa) and Hq > Hkv; a split-KV
      program's own schedule (PROGRAM_DESIGN, what the interpreter verifies) packs.
    - indexed_kv_loop: the same split under a host-table plan (data-dependent masks such as
      document ids or a per-batch prefix), where full blocks are not one interval: the host turns
      the block-class table into per-row lists of partial and of full KV blocks (FlexAttention's
      kv_indices / full_kv_indices) and the loop becomes two loops over those lists, partial blocks
      first, then full ones (no mask code); empty blocks are never visited. Needs the tile's
      q_start and the loop's lower bound to be multiples of BLOCK_M / BLOCK_N (checked statically).
    """

    split_kv_loop: bool = True
    fold_scale: bool = True
    even_headdim: bool = True
    heavy_first: bool = True
    tma: bool = True
    warp_specialize: bool = False
    indexed_kv_loop: bool = True
    pack_gqa: bool = True


def kernel_fn_name(k: Kernel) -> str:
    return f"_{k.name}_kernel"


# ------------------------------------------------------------------ block classes


class BlockMaskKind(Enum):
    NO_MASK = "no_mask"  # classes follow from the tile bounds alone
    ANALYTIC = "analytic"  # an `|` of conjunctions L_i <= alpha*q_idx + beta*kv_idx <= U_j, decided on the tile corners
    TABLE = "table"  # host-computed table, read by the kernel


@dataclass(frozen=True)
class LinearBounds:
    """`L_i <= alpha*q_idx + beta*kv_idx <= U_j` for every bound: one conjunct of mask_mod's `|` (one direction).

    Bounds are integer Exprs over b, h, dims, int scalars and loads from int aux tensors at indices free
    of q_idx/kv_idx (a per-batch prefix length `prefix[b]`), so a program reads them once."""

    alpha: int
    beta: int
    lower: tuple[Expr, ...] = ()
    upper: tuple[Expr, ...] = ()


@dataclass(frozen=True)
class BlockMaskPlan:
    kind: BlockMaskKind
    disjuncts: tuple[LinearBounds, ...] = ()  # ANALYTIC: the mask is their `|`; a block is full when one of them
    # covers it, empty when every one misses it (exact for one disjunct; prefix-LM = two)
    per_b: bool = False  # TABLE: does the class depend on b / h?
    per_h: bool = False


_BOUNDS = FLIP.keys() - {ExprOp.NE}  # the comparisons a bound can be read from


def _int_expr(e: Expr) -> bool:
    return all(n.op not in (ExprOp.DIV, ExprOp.EXP, ExprOp.EXP2, ExprOp.LOG, ExprOp.TANH, ExprOp.SIGMOID, ExprOp.SQRT)
               and not (n.op is ExprOp.CONST and isinstance(n.value, float)) for n in walk(e))


def plan_block_mask(p: Program) -> BlockMaskPlan:
    """Decide how block classes are computed for `p`'s mask_mod (see module docstring)."""
    if p.mask_mod is None:
        return BlockMaskPlan(BlockMaskKind.NO_MASK)
    not_int = {q.name for q in p.params if q.role in (Role.SCALAR, Role.AUX) and _KIND[q.dtype] is not Kind.INT}
    bounds = [_linear_bounds(d, not_int) for d in disjuncts(p.mask_mod.body)]
    if any(d is None for d in bounds):
        return _table_plan(p)
    return BlockMaskPlan(BlockMaskKind.ANALYTIC, tuple(d for d in bounds if d is not None))


def _linear_bounds(e: Expr, not_int: set[str]) -> LinearBounds | None:
    """`e` as bounds on one linear form of q_idx/kv_idx with unit coefficients, or None."""
    direction: tuple[int, int] | None = None
    lower: list[Expr] = []
    upper: list[Expr] = []
    for atom in conjuncts(e):
        lin = linear_form(Expr(ExprOp.SUB, atom.args)) if atom.op in _BOUNDS else None
        if lin is None or (lin[0], lin[1]) == (0, 0) or not _int_expr(lin[2]) \
                or (free_vars(lin[2]) | loaded_tensors(lin[2])) & not_int:
            return None
        a, b, c = lin
        op = atom.op
        if (a, b) < (0, 0) or (a == 0 and b < 0):  # canonical sign: first nonzero coefficient positive
            a, b, c, op = -a, -b, Expr(ExprOp.NEG, (c,)), FLIP[op]
        if abs(a) > 1 or abs(b) > 1 or direction not in (None, (a, b)):
            return None
        direction = (a, b)
        r = Expr(ExprOp.NEG, (c,))  # a*q + b*kv  op  r
        if op in (ExprOp.GE, ExprOp.EQ):
            lower.append(r)
        if op is ExprOp.GT:
            lower.append(r + 1)
        if op in (ExprOp.LE, ExprOp.EQ):
            upper.append(r)
        if op is ExprOp.LT:
            upper.append(r - 1)
    assert direction is not None
    return LinearBounds(direction[0], direction[1], tuple(lower), tuple(upper))


def _table_plan(p: Program) -> BlockMaskPlan:
    fv = free_vars(p.mask_mod.body) if p.mask_mod else frozenset()
    return BlockMaskPlan(BlockMaskKind.TABLE, per_b="b" in fv, per_h="h" in fv)


def _block_tests(plan: BlockMaskPlan, st: IfBlock, m_dim: str, n_dim: str) -> tuple[Expr, Expr]:
    """(is_empty, is_full) of the BLOCK_M x BLOCK_N tile at st.at as scalar Exprs."""
    q0, k0 = st.at.q_start, st.at.kv_start
    q1 = call("minimum", q0 + var("BLOCK_M"), var(m_dim)) - 1
    k1 = call("minimum", k0 + var("BLOCK_N"), var(n_dim)) - 1
    empty = [Expr(ExprOp.GT, (q0, q1)), Expr(ExprOp.GT, (k0, k1))]
    full = [Expr(ExprOp.LE, (q0, q1)), Expr(ExprOp.LE, (k0 + var("BLOCK_N"), var(n_dim)))]
    if plan.kind is BlockMaskKind.ANALYTIC:
        tests = [_disjunct_tests(d, (q0, q1), (k0, k1), {"b": st.at.b, "h": st.at.h}) for d in plan.disjuncts]
        if len(tests) == 1:
            empty += tests[0][0]
            full += tests[0][1]
        else:
            empty.append(all_of([any_of(e) for e, _ in tests]))
            full.append(any_of([all_of(f) for _, f in tests]))
    return tidy_int(any_of(empty)), tidy_int(all_of(full))


def _form_range(d: LinearBounds, q: tuple[Expr, Expr], k: tuple[Expr, Expr]) -> tuple[Expr, Expr]:
    """(min, max) of alpha*q_idx + beta*kv_idx over q_idx in [q0, q1], kv_idx in [k0, k1]."""
    lo_terms, hi_terms = [], []
    for coef, (lo, hi) in ((d.alpha, q), (d.beta, k)):
        if coef == 1:
            lo_terms.append(lo), hi_terms.append(hi)
        elif coef == -1:
            lo_terms.append(Expr(ExprOp.NEG, (hi,))), hi_terms.append(Expr(ExprOp.NEG, (lo,)))
    g_min, g_max = lo_terms[0], hi_terms[0]
    for a, b in zip(lo_terms[1:], hi_terms[1:]):
        g_min, g_max = g_min + a, g_max + b
    return g_min, g_max


def _disjunct_tests(d: LinearBounds, q: tuple[Expr, Expr], k: tuple[Expr, Expr],
                    at: dict[str, Expr]) -> tuple[list[Expr], list[Expr]]:
    """(terms of `misses every pair of the tile`: any holds, terms of `holds on every pair`: all hold) for one
    conjunct of bounds; exact, since the form takes every integer value between its min and max on a tile."""
    g_min, g_max = _form_range(d, q, k)
    lower = [substitute(x, at) for x in d.lower]
    upper = [substitute(x, at) for x in d.upper]
    empty = [Expr(ExprOp.LT, (g_max, x)) for x in lower] + [Expr(ExprOp.GT, (g_min, x)) for x in upper]
    empty += [Expr(ExprOp.GT, (x, y)) for x in lower for y in upper]
    full = [Expr(ExprOp.GE, (g_min, x)) for x in lower] + [Expr(ExprOp.LE, (g_max, x)) for x in upper]
    return empty, full


def _part_range(coef: int, lo: Expr, hi: Expr) -> tuple[Expr, Expr]:
    """(min, max) of coef * x for x in [lo, hi], coef in {-1, 0, 1}."""
    if coef == 0:
        return const(0), const(0)
    return (lo, hi) if coef == 1 else (Expr(ExprOp.NEG, (hi,)), Expr(ExprOp.NEG, (lo,)))


def _full_span(d: LinearBounds, q: tuple[Expr, Expr], lo: Expr, n: Expr, at: dict[str, Expr]) -> tuple[Expr, Expr]:
    """[first, last]: the kv_start values whose whole BLOCK_N tile (rows q) satisfies `d`, within [lo, n - BLOCK_N]."""
    a_min, a_max = _part_range(d.alpha, *q)
    first, last = lo, n - var("BLOCK_N")
    for x in (substitute(x, at) for x in d.lower):  # g_min >= L
        if d.beta == -1:
            last = call("minimum", last, a_min - var("BLOCK_N") + 1 - x)
        elif d.beta == 1:
            first = call("maximum", first, x - a_min)
    for x in (substitute(x, at) for x in d.upper):  # g_max <= U
        if d.beta == -1:
            first = call("maximum", first, a_max - x)
        elif d.beta == 1:
            last = call("minimum", last, x - a_max - var("BLOCK_N") + 1)
    if d.beta == 0:  # the rows alone decide: every block or none
        rows = all_of([Expr(ExprOp.GE, (a_min, substitute(x, at))) for x in d.lower]
                    + [Expr(ExprOp.LE, (a_max, substitute(x, at))) for x in d.upper])
        first = call("where", rows, first, n)
    return first, last


def _union_span(a: tuple[Expr, Expr], b: tuple[Expr, Expr]) -> tuple[Expr, Expr]:
    """One interval of full blocks inside the union of two: both when they overlap or touch, else the longer."""
    (f1, l1), (f2, l2) = a, b
    if f1 == f2:
        return f1, call("maximum", l1, l2)
    meet = Expr(ExprOp.AND, (Expr(ExprOp.LE, (f2, l1 + 1)), Expr(ExprOp.LE, (f1, l2 + 1))))
    longer = Expr(ExprOp.GE, (l1 - f1, l2 - f2))
    return (call("where", meet, call("minimum", f1, f2), call("where", longer, f1, f2)),
            call("where", meet, call("maximum", l1, l2), call("where", longer, l1, l2)))


def _reach(d: LinearBounds, q: tuple[Expr, Expr], n: Expr, at: dict[str, Expr]) -> Expr:
    """An exclusive bound on kv_start past which every tile of rows q misses `d`."""
    a_min, a_max = _part_range(d.alpha, *q)
    if d.beta == -1 and d.lower:  # g_max = a_max - kv_start >= L
        return min_of([a_max - substitute(x, at) + 1 for x in d.lower])
    if d.beta == 1 and d.upper:  # g_min = a_min + kv_start <= U
        return min_of([substitute(x, at) - a_min + 1 for x in d.upper])
    return n


# ------------------------------------------------------------------ kernels


@dataclass(frozen=True)
class _Tile:
    shape: tuple[str, ...]  # size codes (constexpr names or int literals), in the IR's orientation
    dtype: Dtype
    t: bool = False  # held transposed (a score tile [BLOCK_M, BLOCK_N] of a KV-major kernel, as [BLOCK_N, BLOCK_M])


@dataclass
class _Signature:
    """What every kernel of the program receives (one shared argument list keeps launches uniform)."""

    tensors: tuple[Param, ...]
    dims: tuple[str, ...]
    scalars: tuple[Param, ...]
    table: bool
    pads: list[str] = field(default_factory=list)  # PAD_<dim> constexprs for Full over runtime dims
    even_d: bool = False  # EVEN_D constexpr: D == HEAD_PAD, head-dim masks are dropped
    even_dv: bool = False  # EVEN_DV constexpr: Dv == HEAD_PAD_V, value-head-dim masks are dropped
    consts: tuple[str, ...] = SCHEDULE_CONSTANTS  # the schedule constants the kernels receive (launch_constants)
    pos_scalars: list[str] = field(default_factory=list)  # POS_<scalar> constexprs: scalar > 0 (fold_scale)
    tma: bool = False  # USE_TMA constexpr (LowerOptions.tma)
    ws: bool = False  # WARP_SPEC constexpr (LowerOptions.warp_specialize, with tma)
    tma_tensors: list[str] = field(default_factory=list)  # tensors with a descriptor form somewhere

    def args(self) -> list[str]:
        out = [f"{t.name}_ptr" for t in self.tensors]
        out += [f"stride_{t.name}_{i}" for t in self.tensors for i in range(len(t.shape))]
        out += list(self.dims) + [s.name for s in self.scalars]
        if self.table:
            out += ["bc_ptr", "stride_bc_0", "stride_bc_1", "stride_bc_2", "stride_bc_3", "bc_nb", "bc_nh", "bc_nm", "bc_nn"]
            out += ["kvl_ptr", *(f"stride_kvl_{i}" for i in range(5))]
        return out

    def constexprs(self) -> list[str]:
        return list(self.consts) + self.pads + (["EVEN_D"] if self.even_d else []) \
            + (["EVEN_DV"] if self.even_dv else []) + [f"POS_{n}" for n in self.pos_scalars] + (["USE_TMA"] if self.tma else []) + (["WARP_SPEC"] if self.ws else [])


@dataclass(frozen=True)
class _Region:
    """One part of a split KV loop: the block classes its tiles at (b, h, q_start, var) can have."""

    var: str  # the IR loop variable (the tile's kv_start)
    at: tuple[Expr, Expr, Expr]  # (b, h, q_start) shared by every mask / block test in the loop
    classes: frozenset[BlockClass]

    @property
    def full(self) -> bool:
        return self.classes == {BlockClass.FULL}

    def covers(self, st: Mask | IfBlock) -> bool:
        return st.at.kv_start == var(self.var) and (st.at.b, st.at.h, st.at.q_start) == self.at

    def decide(self, st: IfBlock) -> bool | None:
        """Whether `block is st.cls` holds here (before negation); None when it varies per block."""
        if st.cls not in self.classes:
            return False
        return True if self.classes == {st.cls} else None


_SPLIT_PARTIAL = frozenset({BlockClass.EMPTY, BlockClass.PARTIAL})  # closed-form split: partial parts may hold empty blocks


def _reads(st: Stmt) -> set[str]:
    """Names (tiles and scalars) a statement reads, nested bodies included."""
    if isinstance(st, (For, IfBlock)):
        out = set().union(*(_reads(x) for x in walk_stmts(st.body if isinstance(st, For) else st.then + st.orelse)))
        return out | (free_vars(st.lo) | free_vars(st.hi) if isinstance(st, For) else set())
    names: set[str] = set()
    for f in st.__dataclass_fields__:
        val = getattr(st, f)
        if isinstance(val, Expr):
            names |= free_vars(val)
        elif isinstance(val, TileAt):
            names |= {n for x in val for n in free_vars(x)}
        elif isinstance(val, tuple):
            names |= {n for x in val if isinstance(x, Expr) for n in free_vars(x)}
            names |= {n for x in val if isinstance(x, Span) for n in free_vars(x.start)}
    for f in ("a", "b", "src", "tile", "m", "l", "acc", "scores", "values", "value", "o_parts", "lse_parts"):
        val = getattr(st, f, None)
        if isinstance(val, str):
            names.add(val)
    names.update(getattr(st, f) for f in _BACKWARD_READS.get(type(st), ()))
    return names


# tile operands of backward statements not covered by the shared field names above (Finalize's `lse` is an output)
_BACKWARD_READS: dict[type, tuple[str, ...]] = {Probs: ("lse",), SoftmaxGrad: ("p", "dp", "delta")}


def _fold_target(st: Stmt, rest: tuple[Stmt, ...], scalars: set[str]) -> str | None:
    """The scalar c when `st` is `t = t * c` and `t` is then only masked and fed to online_softmax."""
    if not isinstance(st, Elementwise) or st.value.op is not ExprOp.MUL:
        return None
    x, y = st.value.args
    if y.op is ExprOp.VAR and y.value == st.out:
        x, y = y, x
    if not (x.op is ExprOp.VAR and x.value == st.out and y.op is ExprOp.VAR and y.value in scalars):
        return None
    t = st.out
    for nxt in rest:
        for sub in walk_stmts((nxt,)):
            if isinstance(sub, IfBlock) or (isinstance(sub, Mask) and sub.tile == t):
                continue
            if isinstance(sub, OnlineSoftmax) and sub.scores == t:
                return str(y.value) if not any(t in _reads(r) for r in rest[rest.index(nxt) + 1:]) else None
            if t in _reads(sub) or getattr(sub, "out", None) == t:
                return None
    return None


class _KernelGen(StmtVisitor[None]):
    def __init__(self, p: Program, k: Kernel, sig: _Signature, plan: BlockMaskPlan, opts: LowerOptions,
                 pack: PackPlan | None = None) -> None:
        self.p, self.k, self.sig, self.plan, self.opts = p, k, sig, plan, opts
        self.pack = pack  # GQA packing: tile rows are (query head in group, query position) pairs
        self.backward = is_backward(p)  # backward programs: 16-bit tiles widened in elementwise math, dot operand casts
        self.loaded: set[str] = set()  # tiles that hold a load's values (in the tensor's dtype at run time)
        # a backward kernel looping over q blocks (KV-outer: dk, dv of one KV block) holds its score tiles transposed,
        # kv rows by q columns, so P^T and dS^T enter the dV, dK dots as they are (no register transposes)
        self.kv_major = self.backward and pack is None and any(
            isinstance(x, For) and str(x.step) == "BLOCK_M" for x in walk_stmts(k.body))
        self.lets = {st.name: st.value for st in k.body if isinstance(st, Let)}  # top-level lets, for multiple_of
        self.region: _Region | None = None  # set while lowering one part of a split KV loop
        self.folded: dict[str, str] = {}  # score tile -> scalar param whose multiply was folded into exp2
        self.fold_next: dict[str, str] = {}
        self.lines: list[str] = []
        self.depth = 1
        self.names: dict[str, Sym] = {}
        self.tiles: dict[str, _Tile] = {}
        self.offs: list[dict[tuple[str, str], str]] = [{}]
        self.used: set[str] = set()
        # where descriptors of loads inside the outermost loop are built: (line, depth, IR names set in the loop)
        self.hoist: tuple[int, int, set[str]] | None = None
        self.descs: dict[str, str] = {}  # descriptor construction code -> name, while hoisting
        self.deferred: dict[str, tuple[Load, int]] = {}  # split partials a combine reads one split at a time
        self.m_dim, self.n_dim = str(p.param("q").shape[2]), str(p.param("k").shape[2])
        for d in sig.dims:
            self.names[d] = Sym(d, Kind.INT, True)
        if pack is not None:  # a packed tile's rows run over G * M (query head in group, query position)
            self.m_dim = PACK_ROWS
            self.names[PACK_ROWS] = Sym("_pk_rows", Kind.INT, True)
        for c in SCHEDULE_CONSTANTS:
            self.names[c] = Sym(c, Kind.INT, True)
        for s in sig.scalars:
            self.names[s.name] = Sym(s.name, _KIND[s.dtype])
        self.aux = {t.name: AuxRef(f"{t.name}_ptr", tuple(f"stride_{t.name}_{i}" for i in range(len(t.shape))),
                                   tuple(self._dim(d) for d in t.shape), _KIND[t.dtype])
                    for t in sig.tensors if t.role is Role.AUX}

    # -- helpers
    def emit(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def ctx(self, names: dict[str, Sym] | None = None, aux: dict[str, AuxRef] | None = None) -> ExprContext:
        return ExprContext(ExprTarget.DEVICE, self.names if names is None else names, self.aux if aux is None else aux)

    def ex(self, e: Expr) -> str:
        return _strip(lower_expr(e, self.ctx()))

    def position(self, e: Expr) -> str:
        """A KV position (a loop bound): 32-bit, as tile offsets and descriptor loads need, also where it reads
        an int64 aux tensor (a per-batch prefix length)."""
        code = self.ex(e)
        return f"({code}).to(tl.int32)" if any(n.op is ExprOp.LOAD for n in walk(e)) else code

    def local(self, ir_name: str) -> str:
        code = ir_name if ir_name not in _RESERVED and not keyword.iskeyword(ir_name) and not ir_name.startswith("_") \
            and not ir_name.endswith("_ptr") and not ir_name.startswith(("stride_", "offs_", "bc_")) else f"v_{ir_name}"
        return code

    def bind_scalar(self, name: str, e: Expr) -> str:
        code = self.local(name)
        sym = Sym(code, expr_kind(e, self.ctx()), is_nonneg(e, self.ctx()))
        self._invalidate(code)
        self.emit(f"{code} = {self.ex(e)}")
        self.names[name] = sym
        return code

    def _invalidate(self, code: str) -> None:
        pat = re.compile(rf"\b{re.escape(code)}\b")
        for scope in self.offs:
            for key in [k for k in scope if pat.search(k[0])]:
                del scope[key]

    def _dim(self, d: object) -> str:
        return str(d)

    def _full_size(self, d: object) -> str:
        if d == "D":
            return "HEAD_PAD"
        if d == VALUE_DIM:
            return "HEAD_PAD_V"
        if isinstance(d, int):
            return str(next_pow2(d))
        if d in ("HEAD_PAD", "HEAD_PAD_V"):
            return str(d)
        pad = f"PAD_{d}"
        if pad not in self.sig.pads:
            self.sig.pads.append(pad)
        return pad

    def offsets(self, start: Expr | None, size: str) -> str:
        start_code = "0" if start is None else self.ex(start)
        key = (start_code, size)
        for scope in reversed(self.offs):
            if key in scope:
                return scope[key]
        base = "offs_" + (start_code if re.fullmatch(r"[A-Za-z_]\w*", start_code) and start is not None
                          else "d" if size == "HEAD_PAD" else "dv" if size == "HEAD_PAD_V" else "r")
        name, i = base, 1
        while name in self.used:
            i += 1
            name = f"{base}{i}"
        self.used.add(name)
        arange = f"tl.arange(0, {size})"
        self.emit(f"{name} = {arange}" if start is None else f"{name} = {start_code} + {arange}")
        self.offs[-1][key] = name
        return name

    def set_tile(self, ir_name: str, shape: tuple[str, ...], dtype: Dtype, t: bool = False) -> str:
        code = self.local(ir_name)
        self.tiles[ir_name] = _Tile(shape, dtype, t)
        self.loaded.discard(ir_name)
        self.names[ir_name] = Sym(code, _KIND[dtype])
        return code

    def score_shaped(self, shape: tuple[str, ...]) -> bool:
        """Is a tile of this (IR) shape held transposed here (a KV-major kernel's [BLOCK_M, BLOCK_N] tiles)?"""
        return self.kv_major and shape == ("BLOCK_M", "BLOCK_N")

    def oriented(self, ir_name: str, t: bool, code: str | None = None) -> str:
        """The code of tile `ir_name` (or `code` computing it) held transposed iff `t`."""
        code = code or self.local(ir_name)
        return f"tl.trans({code})" if self.tile(ir_name).t != t else code

    def rows(self, ir_name: str, vec: str) -> str:
        """Row vector `vec` (one value per IR row, per q) broadcast over the 2-D tile `ir_name` as it is held."""
        return f"{vec}[None, :]" if self.tile(ir_name).t else f"{vec}[:, None]"

    def tile(self, ir_name: str) -> _Tile:
        try:
            return self.tiles[ir_name]
        except KeyError:
            raise KBError(f"kernel {self.k.name}: tile {ir_name!r} is used before it is defined") from None

    # -- addressing
    def address(self, tensor: str, index: tuple) -> tuple[str, str | None, tuple[str, ...]]:
        """(pointer expression, mask expression or None, tile shape) of `tensor[index]`."""
        try:
            prm = self.p.param(tensor)
        except KeyError:
            raise KBError(f"kernel {self.k.name}: unknown tensor {tensor!r}") from None
        if len(index) != len(prm.shape):
            raise KBError(f"kernel {self.k.name}: {tensor} has {len(prm.shape)} dims, indexed with {len(index)}")
        spans: list[tuple[str, str, str, bool]] = []  # (offs, size, extent, needs lower guard)
        even: list[str] = []  # head-dim bounds, dropped when EVEN_D (EVEN_DV over the value head dim)
        even_flag = "EVEN_D"
        terms: list[str] = []
        rank = sum(not isinstance(i, Expr) for i in index)
        pos = 0
        packed = self.packed_dims(tensor, index)
        for dim_i, (d, item) in enumerate(zip(prm.shape, index)):
            stride = f"stride_{tensor}_{dim_i}"
            if packed is not None and dim_i == packed[0]:
                continue  # the head term is added per row with the query-block span below
            if packed is not None and dim_i == packed[1]:
                assert isinstance(item, Span)
                offs = self.offsets(item.start, str(item.size))
                head, qpos = self.pack_rows(offs)
                bc = offs + _bcast(pos, rank)
                terms += [f"{head}{_bcast(pos, rank)} * stride_{tensor}_{packed[0]}", f"{qpos}{_bcast(pos, rank)} * {stride}"]
                spans.append((bc, str(item.size), "_pk_rows", False))
                pos += 1
                continue
            if isinstance(item, Expr):
                terms.append(f"{_wrap(self.ex(item))} * {stride}")
                continue
            in_full_block = False
            if isinstance(item, Span):
                size = str(item.size)
                offs = self.offsets(item.start, size)
                guard = not is_nonneg(item.start, self.ctx())
                # a full block lies inside [0, N): n_start + BLOCK_N <= N
                in_full_block = self.region is not None and self.region.full and item.start == var(self.region.var) \
                    and size == "BLOCK_N" and d == self.n_dim
            else:
                size = self._full_size(d)
                offs = self.offsets(None, size)
                guard = False
            bc = offs + _bcast(pos, rank)
            terms.append(f"{bc} * {stride}")
            extent = self._dim(d)
            if self.sig.even_d and d == "D" and size == "HEAD_PAD":
                even.append(f"({bc} < {extent})")
            elif self.sig.even_dv and d == VALUE_DIM and size == "HEAD_PAD_V":
                even.append(f"({bc} < {extent})")
                even_flag = "EVEN_DV"
            elif not (isinstance(d, int) and str(d) == size) and not in_full_block:
                spans.append((bc, size, extent, guard))
            pos += 1
        mask_parts = [f"({bc} < {ext})" for bc, _, ext, _ in spans] + [f"({bc} >= 0)" for bc, _, _, g in spans if g]
        if even:
            always = " & ".join(mask_parts)
            both = " & ".join(mask_parts + even)
            mask = f"({always or 'None'} if {even_flag} else {both})"
            return f"{tensor}_ptr + " + " + ".join(terms), mask, tuple(
                str(item.size) if isinstance(item, Span) else self._full_size(d)
                for d, item in zip(prm.shape, index) if not isinstance(item, Expr))
        shape = tuple(str(item.size) if isinstance(item, Span) else self._full_size(d)
                      for d, item in zip(prm.shape, index) if not isinstance(item, Expr))
        return f"{tensor}_ptr + " + " + ".join(terms), " & ".join(mask_parts) or None, shape

    def packed_dims(self, tensor: str, index: tuple) -> tuple[int, int] | None:
        """(head dim, query-block span dim) of an access this packed kernel gathers / scatters per row."""
        if self.pack is None:
            return None
        shape = self.p.param(tensor).shape
        spans = [i for i, (d, it) in enumerate(zip(shape, index)) if row_span(it, d, self.pack)]
        heads = [i for i, (d, it) in enumerate(zip(shape, index)) if it == var(self.pack.head) and d == self.pack.hq]
        return (heads[0], spans[0]) if spans and heads else None

    def pack_rows(self, offs: str) -> tuple[str, str]:
        """Per-row query head and query position of the packed rows `offs` (row r: head h + r // M, position r % M)."""
        assert self.pack is not None
        key = (offs, "__pack__")
        for scope in reversed(self.offs):
            if key in scope:
                return scope[key], f"{offs}_pos"
        head, m = self.names[self.pack.head].code, self.names[self.pack.m].code
        self.emit(f"{offs}_head = {head} + {offs} // {m}  # packed rows: (query head in group, query position)")
        self.emit(f"{offs}_pos = {offs} % {m}")
        self.offs[-1][key] = f"{offs}_head"
        return f"{offs}_head", f"{offs}_pos"

    def tma_desc(self, tensor: str, index: tuple) -> tuple[str, str] | None:
        """(descriptor name, offsets code) of a 2-D tile `tensor[e.., Span|Full, Span|Full]`, or None.

        The descriptor covers the [rows, cols] slice at the leading indices with the dims' true
        extents, so TMA's out-of-range zero fill / store clipping equal the masked form's bounds.
        Packed rows (GQA packing) are a gather, not a tile: no descriptor.
        """
        if not self.sig.tma or self.packed_dims(tensor, index) is not None:
            return None
        prm = self.p.param(tensor)
        n = len(prm.shape)
        if n < 2 or prm.dtype not in (Dtype.BF16, Dtype.F16, Dtype.F32) \
                or any(not isinstance(i, Expr) for i in index[:-2]) or any(isinstance(i, Expr) for i in index[-2:]):
            return None
        sizes, starts = [], []
        for d, item in zip(prm.shape[-2:], index[-2:]):
            if isinstance(item, Span):
                if not is_nonneg(item.start, self.ctx()):
                    return None
                size, start = str(item.size), self.ex(item.start)
            else:
                size, start = self._full_size(d), "0"
            if not (size in SCHEDULE_CONSTANTS or (size.isdigit() and 16 <= int(size) <= 256)):
                return None
            sizes.append(size)
            starts.append(start)
        lead = [(e, f"{_wrap(self.ex(e))} * stride_{tensor}_{i}") for i, e in enumerate(index[:-2])]
        base = " + ".join([f"{tensor}_ptr"] + [t for _, t in lead])
        make = (f"tl.make_tensor_descriptor({base}, shape=[{self._dim(prm.shape[-2])}, {self._dim(prm.shape[-1])}], "
                f"strides=[stride_{tensor}_{n - 2}, 1], block_shape=[{', '.join(sizes)}]) if USE_TMA else None")
        if tensor not in self.sig.tma_tensors:
            self.sig.tma_tensors.append(tensor)
        if self.hoist is not None:
            line, depth, defined = self.hoist
            if any(free_vars(e) & defined for e, _ in lead):
                return None
            return self.before_loop(make, f"_desc_{tensor}"), ", ".join(starts)
        name = self._fresh(f"_desc_{tensor}")
        self.emit(f"{name} = {make}")
        return name, ", ".join(starts)

    def before_loop(self, code: str, base: str) -> str:
        """The name of `code` computed once before the outermost loop (one line per distinct code)."""
        assert self.hoist is not None
        line, depth, defined = self.hoist
        if code not in self.descs:
            name = self._fresh(base)
            self.lines.insert(line, "    " * depth + f"{name} = {code}")
            self.hoist = (line + 1, depth, defined)
            self.descs[code] = name
        return self.descs[code]

    def invariant_terms(self, e: Expr, st: ScoreMod | Mask, names: dict[str, Sym]) -> tuple[Expr, dict[str, Sym]]:
        """`e` with its loads that do not move along the KV loop (free of kv_idx and score, e.g. `doc[b, q_idx]`,
        `prefix[b]`) replaced by names loaded once before the outermost loop; `names` extended with them."""
        if self.hoist is None or any(free_vars(x) & self.hoist[2] for x in (st.at.b, st.at.h, st.at.q_start)):
            return e, names
        q_offs = names["q_idx"].code.split("[")[0]
        if not any(line.lstrip().startswith(f"{q_offs} = ") for line in self.lines[:self.hoist[0]]):
            return e, names  # the query offsets are made inside the loop: nothing to hoist them next to
        names = dict(names)
        ctx = self.ctx(names)

        def visit(x: Expr) -> Expr:
            if not x.args or not free_vars(x).isdisjoint({"kv_idx", "score"}):
                return Expr(x.op, tuple(visit(a) for a in x.args), x.value) if x.args else x
            if not any(n.op is ExprOp.LOAD for n in walk(x)):
                return x
            code = _strip(lower_expr(x, ctx))
            name = self.before_loop(code, "_inv")
            names[name] = Sym(name, expr_kind(x, ctx), is_nonneg(x, ctx))
            return var(name)

        return visit(e), names

    def _fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.used:
            i += 1
            name = f"{base}{i}"
        self.used.add(name)
        return name

    def start_hoist(self, st: For) -> bool:
        """Mark the current line as where descriptors of this (outermost) loop's loads are built."""
        if self.hoist is not None:
            return False
        stmts = list(walk_stmts(st.body))
        defined = {st.var} | {getattr(x, n) for x in stmts for n in ("out", "name", "o", "lse", "m", "l", "acc", "var")
                              if isinstance(getattr(x, n, None), str)}
        self.hoist, self.descs = (len(self.lines), self.depth, defined), {}
        return True

    def end_hoist(self, started: bool) -> None:
        if started:
            self.hoist, self.descs = None, {}

    def loop_range(self, st: For, lo: str, hi: str, step: str) -> str:
        """`range(...)`, or `tl.range(..., warp_specialize=WARP_SPEC)` for an innermost forward loop."""
        if self.sig.ws and not any(isinstance(x, For) for x in walk_stmts(st.body)):
            return f"tl.range({lo}, {hi}, {step}, warp_specialize=WARP_SPEC)"
        return f"range({lo}, {hi}, {step})"

    # -- statements
    def block(self, body: tuple[Stmt, ...]) -> None:
        self.offs.append({})
        before = len(self.lines)
        float_scalars = {q.name for q in self.sig.scalars if _KIND[q.dtype] is Kind.FLOAT}
        fused: set[int] = set()
        for i, st in enumerate(body):
            if i in fused:
                continue
            c = _fold_target(st, body[i + 1:], float_scalars) if self.opts.fold_scale else None
            if c is not None:
                if c not in self.sig.pos_scalars:
                    self.sig.pos_scalars.append(c)
                self.fold_next[st.out] = c  # type: ignore[union-attr]
            acc = self.dot_accumulator(st, body[i + 1:]) if self.backward else None
            if acc is not None:
                self.dot_into(st, acc)  # type: ignore[arg-type]
                fused.add(i + 1)
                continue
            self.visit(st)
        if len(self.lines) == before:
            self.emit("pass")
        self.offs.pop()

    def s_let(self, st: Let) -> None:
        self.bind_scalar(st.name, st.value)

    def split_dim(self, st: Load) -> int | None:
        """The NUM_SPLITS dim of a load of split partials that only a `combine` reads (as its o_parts), when it is
        the tile's first axis: the combine then streams them one split at a time instead of holding them all."""
        shape = self.p.param(st.tensor).shape
        tile_dims = [i for i, it in enumerate(st.index) if not isinstance(it, Expr)]
        if not tile_dims or shape[tile_dims[0]] != "NUM_SPLITS" or not isinstance(st.index[tile_dims[0]], Full):
            return None
        readers = [x for x in walk_stmts(self.k.body) if st.out in _reads(x)]
        ok = len(readers) == 1 and isinstance(readers[0], Combine) and readers[0].o_parts == st.out
        return tile_dims[0] if ok else None

    def s_load(self, st: Load) -> None:
        dim = self.split_dim(st) if st.other == 0.0 else None
        if dim is not None:
            _, _, shape = self.address(st.tensor, st.index)
            self.set_tile(st.out, shape, self.p.param(st.tensor).dtype)
            self.deferred[st.out] = (st, dim)
            self.emit(f"# {self.local(st.out)}: loaded one split at a time by the combine below (each partial read once)")
            return
        ptr, mask, shape = self.address(st.tensor, st.index)
        desc = self.tma_desc(st.tensor, st.index) if st.other == 0.0 else None
        out = self.set_tile(st.out, shape, self.p.param(st.tensor).dtype)
        other = _load_other(mask, _float_code(st.other))
        plain = f"tl.load({ptr}" + (f", mask={mask}, other={other})" if mask else ")")
        self.emit(f"{out} = {desc[0]}.load([{desc[1]}]) if USE_TMA else {plain}" if desc else f"{out} = {plain}")
        self.loaded.add(st.out)

    def s_store(self, st: Store) -> None:
        if st.accumulate:
            self.accumulate_store(st)
            return
        ptr, mask, _ = self.address(st.tensor, st.index)
        value = f"{self.oriented(st.value, False)}.to({st.tensor}_ptr.dtype.element_ty)"
        plain = f"tl.store({ptr}, {value}" + (f", mask={mask})" if mask else ")")
        desc = self.tma_desc(st.tensor, st.index)
        if desc is None:
            self.emit(plain)
            return
        self.emit("if USE_TMA:")
        self.emit(f"    {desc[0]}.store([{desc[1]}], {value})")
        self.emit("else:")
        self.emit(f"    {plain}")

    def s_init(self, st: Init) -> None:
        for d in st.shape:
            if isinstance(d, str) and d not in SCHEDULE_CONSTANTS:
                raise KBError(f"init {st.out}: tile dims must be schedule constants or ints, got {d!r}")
        shape = tuple(str(d) for d in st.shape)
        t = self.score_shaped(shape)
        out = self.set_tile(st.out, shape, st.dtype, t)
        fill = _float_code(st.fill) if _KIND[st.dtype] is Kind.FLOAT else repr(int(st.fill))
        self.emit(f"{out} = tl.full([{', '.join(shape[::-1] if t else shape)}], {fill}, {_TL_DTYPE[st.dtype]})")

    def _prec(self, *tiles: _Tile) -> str:
        return ', input_precision="ieee"' if all(t.dtype is Dtype.F32 for t in tiles) else ""

    def dot_shape(self, st: Dot) -> tuple[str, str]:
        """The (IR-oriented) shape of `st`'s result."""
        a, b = self.tile(st.a), self.tile(st.b)
        return (a.shape[-1] if st.trans_a else a.shape[0], b.shape[0] if st.trans_b else b.shape[-1])

    def s_dot(self, st: Dot) -> None:
        a, b = self.tile(st.a), self.tile(st.b)
        shape = self.dot_shape(st)
        t = self.score_shaped(shape)
        acode, bcode = self.dot_operands(st, t)
        out = self.set_tile(st.out, shape, Dtype.F32, t)
        self.emit(f"{out} = tl.dot({acode}, {bcode}{self._prec(a, b)})")

    def dot_operands(self, st: Dot, out_t: bool = False) -> tuple[str, str]:
        """The operand codes of `st`, transposed as asked. In a backward program a computed fp32 tile (P, dS) meeting a
        loaded one enters the tensor cores in the loaded tile's dtype (FlashAttention's choice; fp32 accumulation).
        An output held transposed is computed as trans(b') @ trans(a'); operands held transposed are used as held."""
        a, b = self.local(st.a), self.local(st.b)
        if self.backward and (st.a in self.loaded) != (st.b in self.loaded):
            if st.a in self.loaded:
                b = f"{b}.to({a}.dtype)"
            else:
                a = f"{a}.to({b}.dtype)"
        if out_t:
            return self.oriented(st.b, not st.trans_b, b), self.oriented(st.a, not st.trans_a, a)
        return self.oriented(st.a, st.trans_a, a), self.oriented(st.b, st.trans_b, b)

    def dot_accumulator(self, st: Stmt, rest: tuple[Stmt, ...]) -> str | None:
        """X when `st` is `dot t = ...` followed by `elementwise X = X + t` (or `t + X`), X an fp32 tile of the dot's
        shape and t read nowhere else: the dot then accumulates into X (`tl.dot(a, b, X)`)."""
        if not isinstance(st, Dot) or not rest or not isinstance(rest[0], Elementwise) or rest[0].value.op is not ExprOp.ADD:
            return None
        acc, t = rest[0].out, st.out
        if sorted(str(x.value) for x in rest[0].value.args if x.op is ExprOp.VAR) != sorted((acc, t)) or acc == t \
                or acc in (st.a, st.b) or acc not in self.tiles or self.tiles[acc].dtype is not Dtype.F32:
            return None
        readers = [x for x in walk_stmts(self.k.body) if not isinstance(x, (For, IfBlock)) and t in _reads(x)]
        return acc if self.tiles[acc].shape == self.dot_shape(st) and readers == [rest[0]] else None

    def dot_into(self, st: Dot, acc: str) -> None:
        acode, bcode = self.dot_operands(st, self.tile(acc).t)
        code = self.local(acc)
        self.emit(f"{code} = tl.dot({acode}, {bcode}, {code}{self._prec(self.tile(st.a), self.tile(st.b))})"
                  f"  # {st.out} = {st.a} @ {st.b} added into {acc}")

    def accumulate_store(self, st: Store) -> None:
        """`store t[...] += x`: relaxed fp32 atomic adds of the in-range elements (programs run in parallel)."""
        prm = self.p.param(st.tensor)
        if prm.dtype is not Dtype.F32:
            raise KBError(f"store {st.tensor}[...] += {st.value}: the Triton lowering accumulates with fp32 atomics; "
                          f"declare {st.tensor} f32 (it is {prm.dtype.value})")
        ptr, mask, _ = self.address(st.tensor, st.index)
        value = f"{self.oriented(st.value, False)}.to(tl.float32)"
        # element atomics: on H200 a TMA reduce-add of the tile (desc.atomic_add) measured slower (2.79 vs 2.35 ms,
        # causal backward B4 H16 S4K D128 at 64x128 w8 s2), the reduce waiting on its shared-memory staging
        self.emit(f"tl.atomic_add({ptr}, {value}" + (f", mask={mask}" if mask else "") + ', sem="relaxed")')

    def s_elementwise(self, st: Elementwise) -> None:
        if st.out in self.fold_next:
            c = self.fold_next.pop(st.out)
            code = self.local(st.out)
            self.folded[st.out] = c
            self.emit(f"# `{code} * {c}` is folded into the softmax exponent when {c} > 0 (POS_{c})")
            self.emit(f"{code} = {code} if POS_{c} else {code} * {self.names[c].code}")
            return
        used = [self.tiles[n] for n in sorted(free_vars(st.value)) if n in self.tiles]
        shape = max((t.shape for t in used), key=len, default=())
        t = any(x.t for x in used)  # held transposed when any operand is (the others are transposed to match)
        code = self.ex(st.value) if not self.backward else _strip(lower_expr(st.value, self.ctx(self.widened(st.value, t))))
        kind = expr_kind(st.value, self.ctx())
        dtype = Dtype.F32 if kind is Kind.FLOAT else Dtype.I32 if kind is Kind.INT else Dtype.BOOL
        if not shape:
            self.bind_scalar(st.out, st.value)
            return
        out = self.set_tile(st.out, shape, dtype, t)
        self.emit(f"{out} = {code}")

    def widened(self, e: Expr, t: bool = False) -> dict[str, Sym]:
        """Names with the loaded float tiles `e` reads widened to fp32 (backward math on 16-bit O, dO: delta), and
        its 2-D tiles held as the result is (transposed iff `t`)."""
        names = dict(self.names)
        for n in free_vars(e) & set(self.tiles):
            tile, code = self.tiles[n], self.names[n].code
            if n in self.loaded and _KIND[tile.dtype] is Kind.FLOAT:
                code = f"{code}.to(tl.float32)"
            if len(tile.shape) == 2 and tile.t != t:
                code = f"tl.trans({code})"
            names[n] = Sym(code, self.names[n].kind)
        return names

    def s_reduce(self, st: Reduce) -> None:
        src = self.tile(st.src)
        if st.kind not in ("max", "sum"):
            raise KBError(f"reduce {st.out}: unknown reduction {st.kind!r} (max or sum)")
        out = self.set_tile(st.out, tuple(s for i, s in enumerate(src.shape) if i != st.axis), src.dtype)
        self.emit(f"{out} = tl.{st.kind}({self.local(st.src)}, {1 - st.axis if src.t else st.axis})")

    def variant_names(self, st: ScoreMod | Mask, score: str | None) -> dict[str, Sym]:
        tile = self.tile(st.tile)
        if len(tile.shape) != 2:
            raise KBError(f"{st.op.value} {st.tile}: expects a 2-D score tile, got shape {tile.shape}")
        om = self.offsets(st.at.q_start, tile.shape[0])
        on = self.offsets(st.at.kv_start, tile.shape[1])
        names = {d: self.names[d] for d in self.sig.dims}
        names.update({s.name: self.names[s.name] for s in self.sig.scalars})
        names["b"] = self.index_sym(st.at.b)
        names["h"] = self.index_sym(st.at.h)
        q_bc, kv_bc = ("[None, :]", "[:, None]") if tile.t else ("[:, None]", "[None, :]")
        names["q_idx"] = Sym(f"{om}{q_bc}", Kind.INT, is_nonneg(st.at.q_start, self.ctx()))
        if self.pack is not None:  # every row has its own query head and position (pack_plans checked q_start)
            head, qpos = self.pack_rows(om)
            names["q_idx"] = Sym(f"{qpos}[:, None]", Kind.INT, True)
            if st.at.h == var(self.pack.head):
                names["h"] = Sym(f"{head}[:, None]", Kind.INT, True)  # no `below`: rows past G * M exceed Hq
        names["kv_idx"] = Sym(f"{on}{kv_bc}", Kind.INT, is_nonneg(st.at.kv_start, self.ctx()))
        if score is not None:
            names["score"] = Sym(score, Kind.FLOAT)
        return names

    def index_sym(self, e: Expr) -> Sym:
        """A batch/head index: a grid axis keeps what the grid knows about it (>= 0, below its extent)."""
        if e.op is ExprOp.VAR and str(e.value) in self.names:
            return self.names[str(e.value)]
        return Sym(_wrap(self.ex(e)), Kind.INT, is_nonneg(e, self.ctx()))

    def s_scoremod(self, st: ScoreMod) -> None:
        if self.p.score_mod is None:
            raise KBError(f"score_mod {st.tile}: the program has no score_mod; add `score_mod(...) = ...` or drop the statement")
        code = self.local(st.tile)
        body, names = self.invariant_terms(self.p.score_mod.body, st, self.variant_names(st, code))
        self.emit(f"{code} = {_strip(lower_expr(body, self.ctx(names)))}")

    def s_mask(self, st: Mask) -> None:
        code = self.local(st.tile)
        if self.region is not None and self.region.full and self.region.covers(st) \
                and self.tile(st.tile).shape == ("BLOCK_M", "BLOCK_N"):
            self.emit(f"# full block: every in-range pair attends and no kv index is past N; no mask for {code}")
            return
        names = self.variant_names(st, None)
        keep = f"({names['kv_idx'].code} < {self.n_dim})"
        if st.use_mask_mod:
            if self.p.mask_mod is None:
                raise KBError(f"mask {st.tile} mask_mod: the program has no mask_mod; add one or use `bounds`")
            body, names = self.invariant_terms(self.p.mask_mod.body, st, names)
            keep += f" & {_wrap(lower_expr(body, self.ctx(names)))}"
        self.emit(f"{code} = tl.where({keep}, {code}, {_NEG_INF})")

    # -- backward statements
    def s_probs(self, st: Probs) -> None:
        s_t, l_t = self.tile(st.scores), self.tile(st.lse)
        if len(s_t.shape) != 2 or len(l_t.shape) != 1:
            raise KBError(f"probs {st.out}: needs a 2-D score tile and a row vector, got {s_t.shape} and {l_t.shape}")
        s, lse = self.local(st.scores), self.local(st.lse)
        lse_bc = self.rows(st.scores, "_lse_log2")
        out = self.set_tile(st.out, s_t.shape, Dtype.F32, s_t.t)
        self.emit(f"# p = exp({s} - {lse}); a row with lse = -inf (nothing attends) and a row past M (lse read as +inf) get 0")
        self.emit(f'_lse_log2 = tl.where({lse} == {_NEG_INF}, float("inf"), {lse}) * {_LOG2E}')
        self.emit(f"{out} = tl.exp2({s} * {_LOG2E} - {lse_bc})")

    def s_softmaxgrad(self, st: SoftmaxGrad) -> None:
        p_t, dp_t, d_t = self.tile(st.p), self.tile(st.dp), self.tile(st.delta)
        if len(p_t.shape) != 2 or dp_t.shape != p_t.shape or len(d_t.shape) != 1:
            raise KBError(f"softmax_grad {st.out}: needs p, dp of one 2-D shape and a row vector delta, "
                          f"got {p_t.shape}, {dp_t.shape} and {d_t.shape}")
        p, dp = self.local(st.p), self.oriented(st.dp, p_t.t)
        delta = self.rows(st.p, self.local(st.delta))
        out = self.set_tile(st.out, p_t.shape, Dtype.F32, p_t.t)
        self.emit(f"{out} = {p} * ({dp} - {delta})")

    def s_scoremodgrad(self, st: ScoreModGrad) -> None:
        from kb.ir.derive import score_grad

        code = self.local(st.tile)
        grad = score_grad(self.p.score_mod.body) if self.p.score_mod is not None else const(1)
        if grad.op is ExprOp.CONST and grad.value == 1:
            self.emit(f"# score_mod_grad {code}: d score_mod / d score is 1 here")
            return
        names = self.variant_names(st, self.oriented(st.scores, self.tile(st.tile).t))
        self.emit(f"{code} = {code} * {_wrap(_strip(lower_expr(grad, self.ctx(names))))}  # d score_mod / d score")

    def s_auxgrad(self, st: AuxGrad) -> None:
        from kb.ir.derive import aux_partials

        if self.p.score_mod is None:
            raise KBError(f"aux_grad {st.grad} of {st.aux}: the program has no score_mod to differentiate")
        try:
            grad = self.p.param(st.grad)
        except KeyError:
            raise KBError(f"aux_grad {st.grad} of {st.aux}: {st.grad} is not a param of the program") from None
        if grad.dtype is not Dtype.F32:
            raise KBError(f"aux_grad {st.grad}: the Triton lowering accumulates with fp32 atomics; declare {st.grad} f32")
        names = self.variant_names(st, self.oriented(st.scores, self.tile(st.tile).t))
        rows, cols = names["q_idx"].code, names["kv_idx"].code
        in_range = f"({rows} < {self.m_dim}) & ({cols} < {self.n_dim})"
        ds = self.local(st.tile)
        for index, partial in aux_partials(self.p.score_mod.body, st.aux):
            if len(index) != len(grad.shape):
                raise KBError(f"aux_grad {st.grad}: {st.aux} is indexed with {len(index)} indices, {st.grad} has {len(grad.shape)} dims")
            self.aux_scatter(st.grad, grad, index, f"{ds} * {_wrap(_strip(lower_expr(partial, self.ctx(names))))}",
                             in_range, names, self.tile(st.tile).t)

    def aux_scatter(self, name: str, grad: Param, index: tuple[Expr, ...], value: str, in_range: str,
                    names: dict[str, Sym], t: bool = False) -> None:
        """grad[index] += value over the in-range tile, summed first over the tile axes the index does not move along."""
        ctx = self.ctx(names)
        terms: list[str] = []
        guards: dict[bool, list[str]] = {True: [], False: []}  # bounds of tile-shaped / scalar indices
        for i, (e, d) in enumerate(zip(index, grad.shape)):
            code = _wrap(_strip(lower_expr(e, ctx)))
            terms.append(f"{code} * stride_{name}_{i}")
            tiled = bool(free_vars(e) & {"q_idx", "kv_idx"})
            if not is_nonneg(e, ctx):
                guards[tiled].append(f"({code} >= 0)")
            if not (e.op is ExprOp.VAR and names.get(str(e.value), Sym("", Kind.INT)).below == self._dim(d)):
                guards[tiled].append(f"({code} < {self._dim(d)})")
        moves = set().union(*(free_vars(e) for e in index)) & {"q_idx", "kv_idx"}
        if moves == {"q_idx", "kv_idx"}:
            val, tile_guards = value, [in_range, *guards[True]]
        else:
            kept = f"tl.where({in_range}, {value}, 0.0)"
            kv_axis, q_axis = (0, 1) if t else (1, 0)
            val = f"tl.sum({kept}, {kv_axis}, keep_dims=True)" if moves == {"q_idx"} else \
                f"tl.sum({kept}, {q_axis}, keep_dims=True)" if moves == {"kv_idx"} else f"tl.sum(tl.sum({kept}, 1), 0)"
            tile_guards = guards[True]
        mask = f", mask={' & '.join(tile_guards)}" if tile_guards else ""
        if guards[False]:  # scalar bounds guard the whole update (a scalar term in a tile mask trips the interpreter)
            self.emit(f"if {' & '.join(guards[False])}:")
        pad = "    " if guards[False] else ""
        self.emit(f"{pad}tl.atomic_add({name}_ptr + {' + '.join(terms)}, {val}{mask}, sem=\"relaxed\")  # d {name}")

    def s_onlinesoftmax(self, st: OnlineSoftmax) -> None:
        if self.tile(st.scores).t:
            raise KBError(f"online_softmax of {st.scores}: not supported in a kernel that loops over q blocks (KV-outer); "
                          "put the forward's KV loop in a kernel of its own")
        m, l, acc, s, v = (self.local(n) for n in (st.m, st.l, st.acc, st.scores, st.values))
        prec = self._prec(self.tile(st.values))
        c = self.folded.pop(st.scores, None)
        if c is None:
            self.emit(f"_m_new = tl.maximum({m}, tl.max({s}, 1))")
        else:
            cc = self.names[c].code
            self.emit(f"_m_new = tl.maximum({m}, tl.max({s}, 1) * ({cc} if POS_{c} else 1.0))")
            self.emit(f"_qk_scale = {cc} * {_LOG2E} if POS_{c} else {_LOG2E}")
        self.emit("# rows with no unmasked score yet keep m = -inf; use 0 there so exp2 sees -inf, never NaN")
        self.emit(f"_m_log2 = tl.where(_m_new == {_NEG_INF}, 0.0, _m_new) * {_LOG2E}")
        self.emit(f"_alpha = tl.exp2({m} * {_LOG2E} - _m_log2)")
        self.emit(f"_p = tl.exp2({s} * {_LOG2E if c is None else '_qk_scale'} - _m_log2[:, None])")
        self.emit(f"{l} = {l} * _alpha + tl.sum(_p, 1)")
        if self._split_p(self.tile(st.values)):
            self.emit(f"# fp32 output from 16-bit V: P enters as a hi/lo pair of {v}.dtype tiles, so P keeps ~16 bits")
            self.emit(f"_p_hi = _p.to({v}.dtype)")
            self.emit(f"{acc} = tl.dot(_p_hi, {v}, {acc} * _alpha[:, None])")
            self.emit(f"{acc} = tl.dot((_p - _p_hi.to(tl.float32)).to({v}.dtype), {v}, {acc})")
        else:
            self.emit(f"{acc} = tl.dot(_p.to({v}.dtype), {v}, {acc} * _alpha[:, None]{prec})")
        self.emit(f"{m} = _m_new")

    def _split_p(self, v: _Tile) -> bool:
        """Whether P·V must keep fp32 accuracy of P: the program writes an fp32 output (a spec that upcasts
        16-bit inputs and returns fp32) from 16-bit V tiles, where one 16-bit P would round it to 8 bits."""
        wide = any(q.role is Role.OUT and q.dtype is Dtype.F32 and q.name != "lse" for q in self.p.params)
        return wide and v.dtype in (Dtype.BF16, Dtype.F16)

    def s_finalize(self, st: Finalize) -> None:
        m, l, acc = (self.local(n) for n in (st.m, st.l, st.acc))
        acc_t, l_t = self.tile(st.acc), self.tile(st.l)
        o = self.set_tile(st.o, acc_t.shape, Dtype.F32)
        lse = self.set_tile(st.lse, l_t.shape, Dtype.F32)
        self.emit(f"_l_safe = tl.where({l} == 0.0, 1.0, {l})")
        self.emit(f"{o} = {acc} / _l_safe[:, None]")
        self.emit(f"{lse} = tl.where({l} == 0.0, {_NEG_INF}, {m} + tl.log(_l_safe))")

    def s_combine(self, st: Combine) -> None:
        po_t, pl_t = self.tile(st.o_parts), self.tile(st.lse_parts)
        if len(po_t.shape) != len(pl_t.shape) + 1:
            raise KBError(f"combine {st.o}: o_parts must have one more dim than lse_parts")
        po, pl = self.local(st.o_parts), self.local(st.lse_parts)
        o = self.set_tile(st.o, po_t.shape[1:], Dtype.F32)
        lse = self.set_tile(st.lse, pl_t.shape[1:], Dtype.F32)
        w_bc = "[" + ", ".join([":"] * len(pl_t.shape) + ["None"]) + "]"
        self.emit(f"_lse_max = tl.max({pl}, 0)")
        self.emit(f"_lse_max = tl.where(_lse_max == {_NEG_INF}, 0.0, _lse_max)")
        self.emit(f"_w = tl.exp({pl} - _lse_max[None, :])  # splits without keys have lse = -inf: weight 0")
        self.emit("_w_sum = tl.sum(_w, 0)")
        self.emit("_w_safe = tl.where(_w_sum == 0.0, 1.0, _w_sum)")
        self.emit(f"{lse} = tl.where(_w_sum == 0.0, {_NEG_INF}, _lse_max + tl.log(_w_safe))")
        if st.o_parts not in self.deferred:
            self.emit(f"{o} = tl.sum(_w{w_bc} * {po}, 0) / _w_safe[:, None]")
            return
        load, dim = self.deferred.pop(st.o_parts)
        one = w_bc.replace(":, ", "", 1)
        self.emit(f"{o} = tl.zeros([{', '.join(po_t.shape[1:])}], tl.float32)")
        self.emit("for _sp in range(0, NUM_SPLITS):  # one split's partial at a time, weighted by its share of the sum")
        self.depth += 1
        self.offs.append({})
        self.names["_sp"] = Sym("_sp", Kind.INT, True)
        ptr, mask, _ = self.address(load.tensor, tuple(var("_sp") if i == dim else it for i, it in enumerate(load.index)))
        self.emit(f"_w_sp = tl.sum(tl.where(tl.arange(0, {pl_t.shape[0]}){_bcast(0, len(pl_t.shape))} == _sp, _w, 0.0), 0)")
        other = _load_other(mask, "0.0")
        self.emit(f"{o} += _w_sp{one} * tl.load({ptr}" + (f", mask={mask}, other={other})" if mask else ")"))
        self.offs.pop()
        self.depth -= 1
        self.emit(f"{o} = {o} / _w_safe[:, None]")

    def split_at(self, st: For) -> tuple[Expr, Expr, Expr] | None:
        """(b, h, q_start) of the loop's tile when the KV loop can be split by block class in closed form."""
        plan = self.plan
        if not self.opts.split_kv_loop or plan.kind is BlockMaskKind.TABLE \
                or any(d.beta == 0 and d.alpha == 0 for d in plan.disjuncts) \
                or (self.pack is not None and plan.kind is not BlockMaskKind.NO_MASK):
            return None
        return self.loop_tile(st, ("forward", "reverse"))

    def indexed_at(self, st: For) -> tuple[Expr, Expr, Expr] | None:
        """(b, h, q_start) of the loop's tile when the KV loop can run over the host's block lists."""
        if not self.opts.indexed_kv_loop or not self.sig.table or self.pack is not None:
            return None
        # the lists visit partial, then full blocks, ascending, whatever the IR's order (the order only moves
        # rounding): a reverse loop over a table would otherwise branch on every block up to its bound
        at = self.loop_tile(st, ("forward", "reverse"))
        if at is None or not self.multiple_of(at[2], "BLOCK_M") or not self.multiple_of(st.lo, "BLOCK_N"):
            return None
        return at

    def multiple_of(self, e: Expr, unit: str) -> bool:
        """Is `e` a multiple of the constexpr `unit` by its form (0, unit * x, sums, min/max, lets)?"""
        if e.op is ExprOp.CONST:
            return e.value == 0
        if e.op is ExprOp.VAR:
            return e.value == unit or (str(e.value) in self.lets and self.multiple_of(self.lets[str(e.value)], unit))
        if e.op is ExprOp.MUL:
            return any(self.multiple_of(a, unit) for a in e.args)
        if e.op in (ExprOp.ADD, ExprOp.SUB, ExprOp.MAXIMUM, ExprOp.MINIMUM):
            return all(self.multiple_of(a, unit) for a in e.args)
        return e.op is ExprOp.NEG and self.multiple_of(e.args[0], unit)

    def loop_tile(self, st: For, orders: tuple[str, ...] = ("forward",)) -> tuple[Expr, Expr, Expr] | None:
        """(b, h, q_start) when every mask / block test in a BLOCK_N loop (in one of `orders`) concerns the loop's own tile."""
        if self.region is not None or st.order not in orders or str(st.step) != "BLOCK_N":
            return None
        stmts = list(walk_stmts(st.body))
        tests = [x for x in stmts if isinstance(x, (Mask, IfBlock))]
        if not tests or any(isinstance(x, For) for x in stmts):
            return None
        at = (tests[0].at.b, tests[0].at.h, tests[0].at.q_start)
        defined = {st.var} | {getattr(x, n) for x in stmts for n in ("out", "name", "o", "lse", "m", "l", "acc")
                              if isinstance(getattr(x, n, None), str)}
        if any(x.at.kv_start != var(st.var) or (x.at.b, x.at.h, x.at.q_start) != at for x in tests):
            return None
        if any(free_vars(e) & defined for e in at):
            return None
        return at

    def s_for(self, st: For) -> None:
        at = self.split_at(st)
        if at is not None:
            self.split_for(st, at)
            return
        at = self.indexed_at(st)
        if at is not None:
            self.indexed_for(st, at)
            return
        lo, hi, step = self.ex(st.lo), self.ex(st.hi), str(st.step)
        loop_var = self.local(st.var)
        self._invalidate(loop_var)
        sym = Sym(loop_var, Kind.INT, is_nonneg(st.lo, self.ctx()), self.loop_below(st))
        if st.order not in ("reverse", "forward"):
            raise KBError(f"for {st.var}: unknown order {st.order!r} (forward or reverse)")
        started = self.start_hoist(st)
        if st.order == "reverse":
            n_iter = f"_n_iter_{loop_var}"
            self.emit(f"{n_iter} = tl.cdiv({hi} - {_wrap(lo)}, {step})")
            self.emit(f"for _it_{loop_var} in range(0, {n_iter}):")
            self.depth += 1
            self.emit(f"{loop_var} = {_wrap(lo)} + ({n_iter} - 1 - _it_{loop_var}) * {step}")
            self.depth -= 1
        else:
            self.emit(f"for {loop_var} in {self.loop_range(st, lo, hi, step)}:")
        self.names[st.var] = sym
        self.depth += 1
        self.block(st.body)
        self.depth -= 1
        self.end_hoist(started)

    def loop_below(self, st: For) -> str | None:
        """The dim a loop variable stays below, when the bound says so: `hi` a dim, or a GQA group's head range
        `(g + 1) * (H // G)` with g a grid axis below G (aux loads indexed by it then need no guard)."""
        hi = st.hi
        if hi.op is ExprOp.VAR and str(hi.value) in self.sig.dims:
            return str(hi.value)
        if hi.op is not ExprOp.MUL or not self.backward:
            return None
        g1, ratio = hi.args
        if ratio.op is not ExprOp.FLOORDIV or g1.op is not ExprOp.ADD or g1.args[1] != const(1) \
                or g1.args[0].op is not ExprOp.VAR or any(a.op is not ExprOp.VAR for a in ratio.args):
            return None
        g = self.names.get(str(g1.args[0].value))
        big, small = (str(a.value) for a in ratio.args)
        return big if g is not None and g.below == small and big in self.sig.dims else None

    def split_for(self, st: For, at: tuple[Expr, Expr, Expr]) -> None:
        """Three loops over [lo, hi): partial blocks, then full blocks, then partial blocks (ascending order)."""
        v = self.local(st.var)
        q0 = at[2]
        q1 = call("minimum", q0 + var("BLOCK_M"), var(self.m_dim)) - 1
        sub = {"b": at[0], "h": at[1]}
        spans = [_full_span(d, (q0, q1), st.lo, var(self.n_dim), sub) for d in self.plan.disjuncts] \
            or [(st.lo, var(self.n_dim) - var("BLOCK_N"))]
        first, last = spans[0]
        for f, l in spans[1:]:
            first, last = _union_span((first, last), (f, l))
        hi_expr = st.hi
        if len(self.plan.disjuncts) > 1:  # a union: past the last key any disjunct can reach, every block is empty
            hi_expr = call("minimum", hi_expr, max_of([_reach(d, (q0, q1), var(self.n_dim), sub) for d in self.plan.disjuncts]))
        self.emit("# KV loop split by block class: partial blocks, full blocks (no mask code), partial blocks")
        lo, hi = f"_kv_lo_{v}", f"_kv_hi_{v}"
        self.emit(f"{lo} = {self.position(st.lo)}")
        self.emit(f"{hi} = {self.position(tidy_int(hi_expr))}")
        self.emit(f"_n_iter_{v} = tl.cdiv(tl.maximum({hi} - {lo}, 0), BLOCK_N)")
        self.emit(f"_full_first_{v} = {self.position(tidy_int(first))}")
        self.emit(f"_full_last_{v} = {self.position(tidy_int(last))}")
        self.emit(f"_i_a_{v} = tl.minimum(tl.cdiv(tl.maximum(_full_first_{v} - {lo}, 0), BLOCK_N), _n_iter_{v})")
        self.emit(f"_i_b_{v} = tl.minimum(tl.maximum(tl.where(_full_last_{v} >= {lo}, "
                  f"(_full_last_{v} - {lo}) // BLOCK_N + 1, 0), _i_a_{v}), _n_iter_{v})")
        parts = [("0", f"_i_a_{v}", False), (f"_i_a_{v}", f"_i_b_{v}", True), (f"_i_b_{v}", f"_n_iter_{v}", False)]
        if st.order == "reverse":  # the same parts, last first, each descending: the IR's order exactly
            parts.reverse()
        started = self.start_hoist(st)
        for i_lo, i_hi, full in parts:
            self._invalidate(v)
            self.names[st.var] = Sym(v, Kind.INT, is_nonneg(st.lo, self.ctx()))
            what = "full" if full else "partial"
            if st.order == "reverse":
                it = f"_it_{v}"
                self.emit(f"for {it} in range(0, {i_hi} - {i_lo}):  # {what} blocks, descending")
                self.emit(f"    {v} = {lo} + ({i_hi} - 1 - {it}) * BLOCK_N")
            else:
                a = lo if i_lo == "0" else f"{lo} + {i_lo} * BLOCK_N"
                b = hi if i_hi == f"_n_iter_{v}" else f"{lo} + {i_hi} * BLOCK_N"
                self.emit(f"for {v} in {self.loop_range(st, a, b, 'BLOCK_N')}:  # {what} blocks")
            self.region = _Region(st.var, at, frozenset({BlockClass.FULL}) if full else _SPLIT_PARTIAL)
            self.depth += 1
            self.block(st.body)
            self.depth -= 1
            self.region = None
        self.end_hoist(started)

    def indexed_for(self, st: For, at: tuple[Expr, Expr, Expr]) -> None:
        """Two loops over the host's lists of partial, then full, KV blocks of this tile row in [lo, hi)."""
        v = self.local(st.var)
        b = self.ex(at[0]) if self.plan.per_b else "0"
        h = self.ex(at[1]) if self.plan.per_h else "0"
        row, j_lo, j_hi = f"_kvl_row_{v}", f"_j_lo_{v}", f"_j_hi_{v}"
        self.emit("# KV loop over the host's block lists (kvl[b, h, m_block, class] = cumulative counts, then block")
        self.emit("# indices): partial blocks, then full blocks (no mask code); empty blocks are never visited")
        self.emit(f"{row} = kvl_ptr + {_wrap(b)} * stride_kvl_0 + {_wrap(h)} * stride_kvl_1 "
                  f"+ ({_wrap(self.ex(at[2]))} // BLOCK_M) * stride_kvl_2")
        lo = self.ex(st.lo)
        self.emit(f"{j_lo} = {lo if is_nonneg(st.lo, self.ctx()) else f'tl.maximum({lo}, 0)'} // BLOCK_N")
        self.emit(f"{j_hi} = tl.maximum(tl.minimum(tl.cdiv({self.ex(st.hi)}, BLOCK_N), bc_nn), {j_lo})")
        started = self.start_hoist(st)
        for cls in (BlockClass.PARTIAL, BlockClass.FULL):
            lst, it = f"_kvl_{cls.value}_{v}", f"_i_{cls.value}_{v}"
            self.emit(f"{lst} = {row} + {CLASS_CODE[cls] - PARTIAL} * stride_kvl_3")
            self._invalidate(v)
            self.names[st.var] = Sym(v, Kind.INT, True)
            self.emit(f"for {it} in range(tl.load({lst} + {j_lo} * stride_kvl_4), tl.load({lst} + {j_hi} * stride_kvl_4)):")
            self.depth += 1
            self.emit(f"{v} = tl.load({lst} + (bc_nn + 1 + {it}) * stride_kvl_4) * BLOCK_N  # {cls.value} blocks")
            self.region = _Region(st.var, at, frozenset({cls}))
            self.block(st.body)
            self.region = None
            self.depth -= 1
        self.end_hoist(started)

    def s_ifblock(self, st: IfBlock) -> None:
        if self.region is not None and self.region.covers(st):
            holds = self.region.decide(st)
            if holds is not None:
                cond = f"{'not ' if st.negate else ''}block is {st.cls.value}"
                self.emit(f"# `{cond}` is {holds != st.negate} in every block of this part of the split loop")
                taken = st.then if holds != st.negate else st.orelse
                for sub in taken:
                    self.visit(sub)
                return
        cond = self.block_condition(st)
        self.emit(f"if {cond}:")
        self.depth += 1
        self.block(st.then)
        self.depth -= 1
        if st.orelse:
            self.emit("else:")
            self.depth += 1
            self.block(st.orelse)
            self.depth -= 1

    def block_condition(self, st: IfBlock) -> str:
        code = CLASS_CODE[st.cls]
        op = "!=" if st.negate else "=="
        if self.plan.kind is BlockMaskKind.TABLE:
            bq, bk = var("BLOCK_M"), var("BLOCK_N")
            aligned = Expr(ExprOp.AND, (Expr(ExprOp.EQ, (Expr(ExprOp.MOD, (st.at.q_start, bq)), const(0))),
                                        Expr(ExprOp.EQ, (Expr(ExprOp.MOD, (st.at.kv_start, bk)), const(0)))))
            cell = load("__bc", st.at.b if self.plan.per_b else const(0), st.at.h if self.plan.per_h else const(0),
                        Expr(ExprOp.FLOORDIV, (st.at.q_start, bq)), Expr(ExprOp.FLOORDIV, (st.at.kv_start, bk)))
            aux = {**self.aux, "__bc": AuxRef("bc_ptr", tuple(f"stride_bc_{i}" for i in range(4)),
                                              ("bc_nb", "bc_nh", "bc_nm", "bc_nn"), Kind.INT)}
            cls = lower_expr(call("where", aligned, cell, const(PARTIAL)), self.ctx(aux=aux))
            self.emit("# block class from the host table (0 empty, 1 partial, 2 full); unaligned tiles are partial")
            self.emit(f"_bclass = {cls}")
            return f"_bclass {op} {code}"
        empty, full = _block_tests(self.plan, st, self.m_dim, self.n_dim)
        self.emit(f"# block class in closed form ({self.plan.kind.value}) for the tile at "
                  f"({_strip(self.ex(st.at.q_start))}, {_strip(self.ex(st.at.kv_start))})")
        if st.cls is BlockClass.FULL:
            test = full
        elif st.cls is BlockClass.EMPTY:
            test = empty
        else:
            test = Expr(ExprOp.AND, (Expr(ExprOp.NOT, (empty,)), Expr(ExprOp.NOT, (full,))))
        self.emit(f"_is_{st.cls.value} = {self.ex(test)}")
        return f"not _is_{st.cls.value}" if st.negate else f"_is_{st.cls.value}"

    # -- whole kernel
    def axis_value(self, axis: str, index: str) -> str:
        """A grid axis' value from its flat index; packed, the head axis is the group's first query head."""
        if self.pack is not None and axis == self.pack.head:
            return f"{_wrap(index)} * ({self.pack.hq} // {self.pack.hkv})"
        return index

    def moves_kv_bound(self, axis: str) -> bool:
        """Does a top-level loop's upper bound depend on grid axis `axis` (through lets)?"""
        deps: dict[str, set[str]] = {}
        for st in self.k.body:
            if isinstance(st, Let):
                fv = free_vars(st.value)
                deps[st.name] = set(fv).union(*(deps.get(n, set()) for n in fv))
            if isinstance(st, For):
                fv = free_vars(st.hi)
                if axis in set(fv).union(*(deps.get(n, set()) for n in fv)):
                    return True
        return False

    def generate(self) -> list[str]:
        axes = self.k.grid
        pk = self.pack
        self.emit(f"# grid ({', '.join(f'{a.name}: {a.extent}' for a in axes)}), flattened; the last axis varies fastest")
        if pk is not None:
            self.emit(f"# GQA packed: {pk.head} runs over the {pk.hkv} KV heads, {pk.rows} over cdiv(({pk.hq} // {pk.hkv}) * {pk.m}, "
                      f"BLOCK_M) blocks of (query head in group, query position) rows")
            self.emit(f"_pk_rows = ({pk.hq} // {pk.hkv}) * {pk.m}")
        heavy = self.opts.heavy_first and len(axes) > 1 and self.moves_kv_bound(axes[-1].name)
        if len(axes) == 1:
            self.emit(f"{self.local(axes[0].name)} = {self.axis_value(axes[0].name, 'tl.program_id(0)')}")
        else:
            self.emit("pid = tl.program_id(0)")
            for a in reversed(axes[1:]):
                ext = _wrap(self.ex(pk.extent(a.name, a.extent) if pk else a.extent))
                if heavy and a is axes[-1]:
                    self.emit(f"# `{a.name}` moves the KV loop bound: largest {a.name} first, so the launch ends on short programs")
                    self.emit(f"{self.local(a.name)} = {ext} - 1 - pid % {ext}")
                else:
                    self.emit(f"{self.local(a.name)} = {self.axis_value(a.name, f'pid % {ext}')}")
                self.emit(f"pid = pid // {ext}")
            self.emit(f"{self.local(axes[0].name)} = {self.axis_value(axes[0].name, 'pid')}")
        for a in axes:
            below = _wrap(self.ex(a.extent)) if a.extent.op is ExprOp.VAR else None
            self.names[a.name] = Sym(self.local(a.name), Kind.INT, True, below)
        self.block(self.k.body)
        return self.lines


def _float_code(x: float) -> str:
    """A float constant as Triton / Python source (infinities as float(...))."""
    if x == float("-inf"):
        return _NEG_INF
    return 'float("inf")' if x == float("inf") else repr(float(x))


def _strip(code: str) -> str:
    """Drop one pair of redundant outer parentheses."""
    if code.startswith("(") and code.endswith(")"):
        depth = 0
        for i, ch in enumerate(code):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and i < len(code) - 1:
                return code
        return code[1:-1]
    return code


def _wrap(code: str) -> str:
    """Parenthesise unless `code` is atomic or already one parenthesised group."""
    atomic = re.fullmatch(r"[\w.]+", code) or (code.startswith("(") and _strip(code) != code)
    return code if atomic else f"({code})"


def _load_other(mask: str | None, other: str) -> str:
    """`other` for a tl.load under `mask`; a mask that is None when EVEN_D / EVEN_DV holds gets None there too
    (tl.load refuses `other` without a mask)."""
    flag = re.match(r"\(None if (EVEN_DV?) ", mask or "")
    return f"(None if {flag.group(1)} else {other})" if flag else other


def _bcast(pos: int, rank: int) -> str:
    if rank == 1:
        return ""
    return "[" + ", ".join(":" if i == pos else "None" for i in range(rank)) + "]"


# ------------------------------------------------------------------ module


_PREAMBLE = '''\
import logging
import math
import weakref
import os

import torch
import triton
import triton.language as tl

_log = logging.getLogger("kernel_kb.generated")


def _interpreter_compat():
    """Two Triton 3.6 interpreter bugs, fixed here only when interpreting:
    scalars become ints through int(array of shape (1,)), which NumPy >= 2.4 refuses
    (triton-lang/triton#9171; `range` over runtime bounds needs it), and `tl.dot` multiplies
    the raw uint16 storage of bf16 operands; they are widened to fp32 first (exact, as on GPUs).
    And two slow paths that compute nothing (_interpreter_speed)."""
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_kb_compat", False):
        return
    _interpreter_speed(interpreter)
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    create_dot = interpreter.InterpreterBuilder.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter._patch_lang_tensor = patched
    interpreter.InterpreterBuilder.create_dot = dot
    interpreter._kb_compat = True


def _interpreter_speed(interpreter):
    """Two interpreter costs that change no result, skipped (a decode kernel's CPU check ran 2-4x slower with them):
    - every integer +, -, * builds an int64 overflow check through the semantic layer whose only effect is a
      device_assert, which the interpreter drops unless debugging (options.debug); it now runs only then;
    - every call of a @triton.jit helper (tl.cdiv, tl.max, tl.sum, ...) re-patched triton.language with
      inspect.getmembers; within one grid run, modules already patched for it are not patched again."""
    semantic = interpreter.interpreter_semantic
    sanitize = semantic.binary_op_sanitize_overflow_impl

    def overflow_check(lhs, rhs, binary_op):
        if semantic.builder.options.debug:
            sanitize(lhs, rhs, binary_op)

    semantic.binary_op_sanitize_overflow_impl = overflow_check
    patch_lang, grid_call, patched = interpreter._patch_lang, interpreter.GridExecutor.__call__, []

    class _Kept:
        def restore(self):
            pass

    def lang_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if patched and langs <= patched[-1]:
            return _Kept()  # already patched in this grid run (device-function scopes are never restored anyway)
        scope = patch_lang(fn)
        if patched:
            patched[-1].update(langs)
        return scope

    def run_grid(self, *args, **kwargs):
        patched.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = lang_once
    interpreter.GridExecutor.__call__ = run_grid


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_compat()


@triton.jit
def _floordiv(a, b):
    q = a // b
    return tl.where((a % b != 0) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def _floormod(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


def _tensor(*xs):
    return any(isinstance(x, torch.Tensor) for x in xs)


def _hcdiv(a, b):
    return -(-a // b)


def _hmaximum(a, b):
    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b)) if _tensor(a, b) else max(a, b)


def _hminimum(a, b):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b)) if _tensor(a, b) else min(a, b)


def _hwhere(c, x, y):
    return torch.where(torch.as_tensor(c), torch.as_tensor(x), torch.as_tensor(y)) if _tensor(c, x, y) else (x if c else y)


def _hnot(x):
    return ~x if isinstance(x, torch.Tensor) else not x


def _hfloat(f):
    return lambda x: f(torch.as_tensor(x).float())


_hexp, _hexp2, _hlog, _htanh = _hfloat(torch.exp), _hfloat(torch.exp2), _hfloat(torch.log), _hfloat(torch.tanh)
_hsigmoid, _hsqrt, _habs = _hfloat(torch.sigmoid), _hfloat(torch.sqrt), lambda x: torch.as_tensor(x).abs()
_htrunc = lambda x: torch.as_tensor(x).long() if _tensor(x) else int(x)  # toward zero (IR trunc)


def _hload(t, idx):
    """t[idx] with broadcast index tensors; out-of-range elements read 0 (the IR's load rule)."""
    idx = torch.broadcast_tensors(*(torch.as_tensor(i, device=t.device).long() for i in idx))
    ok = torch.ones(idx[0].shape, dtype=torch.bool, device=t.device)
    for i, n in zip(idx, t.shape):
        ok &= (i >= 0) & (i < n)
    vals = t[tuple(torch.where(ok, i, 0) for i in idx)]
    return torch.where(ok, vals, torch.zeros((), dtype=t.dtype, device=t.device))


def _hblock_classes(launch, nb, nh, M, N, BLOCK_M, BLOCK_N, device):
    """[nb, nh, cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)] int8: 0 empty, 1 partial, 2 full (IR block classes), filled by
    `launch(bc)`: the module's block-class kernel, one program per tile (no Python loop over batches or blocks)."""
    bc = torch.empty(nb, nh, _hcdiv(M, BLOCK_M), _hcdiv(N, BLOCK_N), dtype=torch.int8, device=device)
    if bc.numel():
        launch(bc)
    return bc


_TABLES = {}  # block tables by (design, dims, scalars): the mask inputs they were built from, and the table


def _cached_table(key, mask_inputs, build):
    """The block table for these mask inputs, rebuilt only when one of them changed shape or contents (compared
    element by element with a copy kept here, so a new tensor at a reused address is never taken for the old).
    The very tensors of the last call, unmodified since (torch's version counter), skip the comparison and the
    device synchronisation it costs: a model passing one id tensor to every layer compares it once."""
    hit = _TABLES.get(key)
    if hit is not None:
        copies, table, seen = hit
        if all(ref() is a and a._version == version for a, (ref, version) in zip(mask_inputs, seen)):
            return table
        if all(a.shape == c.shape and a.dtype == c.dtype and a.device == c.device and torch.equal(a, c)
               for a, c in zip(mask_inputs, copies)):
            _TABLES[key] = (copies, table, _witness(mask_inputs))
            return table
    table = build()
    if len(_TABLES) >= 8:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = (tuple(a.detach().clone() for a in mask_inputs), table, _witness(mask_inputs))
    return table


def _witness(tensors):
    return tuple((weakref.ref(t), t._version) for t in tensors)


def _hblock_table(bc):
    return bc, _hblock_lists(bc)


def _hblock_lists(block_class):
    """[nb, nh, nm, 2, 2 * nn + 1] int32 from the class table: for class c (0 partial, 1 full) of each
    row, entries [0, nn] count the blocks of that class before block j, then come their indices ascending."""
    nn = block_class.shape[-1]
    of_class = torch.stack((block_class == 1, block_class == 2), dim=3)
    out = torch.zeros(*of_class.shape[:-1], 2 * nn + 1, dtype=torch.int32, device=block_class.device)
    out[..., 1:nn + 1] = of_class.cumsum(-1)
    out[..., nn + 1:] = torch.argsort((~of_class).to(torch.int8), dim=-1, stable=True)
    return out


_PICKED = {}  # shape key -> the design this module runs for it (chosen once per key)


def _interpreting(t):
    return os.environ.get("TRITON_INTERPRET") == "1" or not t.is_cuda


def _launches(design, launch):
    """Run `launch(design)`; None when the GPU cannot run the design (shared memory or registers)."""
    try:
        return launch(design)
    except triton.runtime.errors.OutOfResources as err:
        _log.info("%s: design %s does not fit this GPU (%s)", PROGRAM, design, err)
        return None


def _choose_design(t, D, key, launch):
    """The design for inputs like `t` with head dim D: on a GPU the module lists designs for (the first
    that fits); on another GPU, the fastest of every design listed for this head dim, timed once per shape
    and logged; under the interpreter, the program's own schedule (the one verified on CPU)."""
    if key in _PICKED:
        return _PICKED[key]
    if _interpreting(t):
        _PICKED[key] = PROGRAM_DESIGN
        return PROGRAM_DESIGN
    arch = "sm%d%d" % torch.cuda.get_device_capability(t.device)
    bucket = max(16, triton.next_power_of_2(D))
    listed = DESIGNS.get(arch, {}).get(bucket, ())
    choice = next((d for d in listed if _launches(d, launch) is not None), None)
    if choice is None:
        # this head dim's designs on any arch, else every listed design (a head dim no table lists, e.g. 192)
        pool = [d for table in DESIGNS.values() for d in table.get(bucket, ())]
        pool = pool or [d for table in DESIGNS.values() for ds in table.values() for d in ds]
        pool = list(dict.fromkeys(pool + [PROGRAM_DESIGN]))
        from triton.testing import do_bench

        timed = [(do_bench(lambda d=d: launch(d), warmup=5, rep=20), d)
                 for d in pool if _launches(d, launch) is not None]
        if not timed:
            raise RuntimeError(f"{PROGRAM}: none of the designs {pool} runs on this GPU ({arch})")
        ms, choice = min(timed)
        why = f"none of the {len(listed)} designs listed" if listed else "no design measured"
        _log.warning("%s: %s for %s at head dim %d fits; timed %d designs for shape %s, running %s (%.3f ms)",
                     PROGRAM, why, arch, D, len(timed), key[2:], choice, ms)
    _PICKED[key] = choice
    return choice


def _design7(design):
    """A design tuple with its GQA-packing flag (tuples written before packing existed have 6 entries: no packing)."""
    return (*design, False)[:7]


_MIN_SPLIT_BLOCKS = 4  # no split shorter than this many KV blocks (each split costs a q load, a partial write and read)


def _auto_splits(programs, kv_blocks, device):
    """Split-KV count for a grid of `programs` (at one split; packed: B * Hkv * row blocks) over `kv_blocks` KV
    blocks, from the SM count (flash-decoding); 1 off CUDA. See _split_rule."""
    if device.type != "cuda":
        return 1
    return _split_rule(programs, kv_blocks, torch.cuda.get_device_properties(device).multi_processor_count)


def _split_rule(programs, kv_blocks, sms):
    """Enough programs for about two waves of `sms` SMs, no split shorter than _MIN_SPLIT_BLOCKS KV blocks, at most
    128; among [that count, twice it] the one that fills its last wave best (the smallest on ties); then the count
    whose splits are all non-empty (every split is a whole number of KV blocks, the last one possibly shorter)."""
    cap = max(1, min(128, kv_blocks // _MIN_SPLIT_BLOCKS))
    want = min(cap, _hcdiv(2 * sms, programs))
    if want <= 1:
        return 1
    busy = {n: programs * n / (_hcdiv(programs * n, sms) * sms) for n in range(want, min(cap, 2 * want) + 1)}
    best = max(busy, key=lambda n: (busy[n], -n))
    return _hcdiv(kv_blocks, _hcdiv(kv_blocks, best))


def _tma_alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _use_tma(tensors, tile_sides):
    """The Hopper tensor-descriptor path (USE_TMA): a CUDA GPU of capability >= 9.0, not interpreting,
    tile sides <= 256, every tensor's last dim contiguous, its base and other strides 16-byte aligned."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not tensors or not all(t.is_cuda for t in tensors):
        return False
    if torch.cuda.get_device_capability(tensors[0].device) < (9, 0) or max(tile_sides) > 256:
        return False
    for t in tensors:
        if t.dim() < 2 or t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
            return False
    triton.set_allocator(_tma_alloc)  # device-side descriptors live in a small global scratch
    return True


class ForwardArgumentError(ValueError):
    """Bad arguments to forward(): a missing aux tensor or scalar, or inconsistent shapes."""


def _bind(dims, name, t, spec):
    if t.dim() != len(spec):
        raise ForwardArgumentError(f"{name}: expected {len(spec)} dims {spec}, got shape {tuple(t.shape)}")
    for d, n in zip(spec, t.shape):
        if isinstance(d, int):
            if d != n:
                raise ForwardArgumentError(f"{name}: expected size {d}, got shape {tuple(t.shape)}")
        elif dims.setdefault(d, n) != n:
            raise ForwardArgumentError(f"{name}: dim {d} is {n} here but {dims[d]} elsewhere")
'''


def lower_program(p: Program, options: LowerOptions | None = None, designs: DesignTable | None = None) -> str:
    """The source text of a standalone Python module running `p` with Triton.

    `designs` ({arch: {head-dim bucket: designs best first}}) are the launch parameters the module picks from on a
    GPU; without them (or for a GPU they miss) it times what it has once per shape, including the program's schedule."""
    opts = options or LowerOptions()
    if is_backward(p):
        from kb.lower.triton_bwd import lower_backward

        return lower_backward(p, opts, designs)
    check_attention_params(p, "Triton")
    plan = plan_block_mask(p)
    sig = program_signature(p, opts, plan)
    packs = _packing(p, opts, designs)
    out = [f'"""Triton kernels for IR program `{p.name}`: generated by kb.lower.triton, do not edit."""', "", _PREAMBLE]
    out += kernel_sources(p, sig, plan, opts, packs)
    if sig.table:
        out += ["", *_class_kernel(p, sig, plan)]
    out += ["", *_design_lines(p, designs, packs), *_host(p, sig, plan, packs)]
    return "\n".join(out).rstrip() + "\n"


def program_signature(p: Program, opts: LowerOptions, plan: BlockMaskPlan) -> _Signature:
    """The argument list every kernel of `p` receives (completed while the kernels are generated)."""
    has_if = any(isinstance(st, IfBlock) for k in p.kernels for st in walk_stmts(k.body))
    tensors = tuple(q for q in p.params if q.role is not Role.SCALAR)
    runtime_dims = tuple(d for d in p.dims() if d not in SCHEDULE_CONSTANTS)
    return _Signature(tensors, runtime_dims, tuple(q for q in p.params if q.role is Role.SCALAR),
                      table=has_if and plan.kind is BlockMaskKind.TABLE, even_d=opts.even_headdim and "D" in runtime_dims,
                      even_dv=opts.even_headdim and VALUE_DIM in runtime_dims, consts=launch_constants(p),
                      tma=opts.tma, ws=opts.tma and opts.warp_specialize)


def kernel_sources(p: Program, sig: _Signature, plan: BlockMaskPlan, opts: LowerOptions, packs: dict | str) -> list[str]:
    """The `@triton.jit` functions of `p`'s kernels (and their packed forms), all with the final shared signature."""
    bodies = [(kernel_fn_name(k), _KernelGen(p, k, sig, plan, opts).generate()) for k in p.kernels]
    if isinstance(packs, dict):
        bodies += [(packed_fn_name(k), _KernelGen(p, k, sig, plan, opts, packs[k.name]).generate()) for k in p.kernels]
    out: list[str] = []
    for fn, lines in bodies:
        args = sig.args() + [f"{c}: tl.constexpr" for c in sig.constexprs()]
        out += ["", "@triton.jit", f"def {fn}(", *(f"    {a}," for a in args), "):", *lines, ""]
    return out


def _class_kernel(p: Program, sig: _Signature, plan: BlockMaskPlan, name: str = "_block_class_kernel") -> list[str]:
    """`_block_class_kernel`: one program per (b, h, m block, n block) of the table writes that tile's class of
    mask_mod (0 empty, 1 partial, 2 full; a tile past N is never full), evaluated in registers on the GPU."""
    assert p.mask_mod is not None
    aux = [q for q in p.params if q.role is Role.AUX]
    q_shape, m_dim, n_dim = p.param("q").shape, str(p.param("q").shape[2]), str(p.param("k").shape[2])
    names = {d: Sym(d, Kind.INT, True) for d in (*sig.dims, *SCHEDULE_CONSTANTS)}
    names.update({q.name: Sym(q.name, _KIND[q.dtype]) for q in sig.scalars})
    for n, dim, used in (("b", q_shape[0], plan.per_b), ("h", q_shape[1], plan.per_h)):
        names[n] = Sym(n, Kind.INT, True, str(dim) if used and isinstance(dim, str) else None)
    names["q_idx"] = Sym("offs_q[:, None]", Kind.INT, True)
    names["kv_idx"] = Sym("offs_kv[None, :]", Kind.INT, True)
    refs = {q.name: AuxRef(f"{q.name}_ptr", tuple(f"stride_{q.name}_{i}" for i in range(len(q.shape))),
                           tuple(str(d) for d in q.shape), _KIND[q.dtype]) for q in aux}
    mask = _strip(lower_expr(p.mask_mod.body, ExprContext(ExprTarget.DEVICE, names, refs)))
    args = [f"{q.name}_ptr" for q in aux] + [f"stride_{q.name}_{i}" for q in aux for i in range(len(q.shape))] \
        + list(sig.dims) + [q.name for q in sig.scalars] \
        + ["bc_ptr", "stride_bc_0", "stride_bc_1", "stride_bc_2", "stride_bc_3", "bc_nh", "bc_nm", "bc_nn",
           "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"]
    body = [
        "# one program per tile of the table [nb, nh, nm, nn], flattened; the mask is evaluated in registers",
        "pid = tl.program_id(0)",
        "j = pid % bc_nn",
        "pid = pid // bc_nn",
        "m = pid % bc_nm",
        "pid = pid // bc_nm",
        "h = pid % bc_nh",
        "b = pid // bc_nh",
        "offs_q = m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "offs_kv = j * BLOCK_N + tl.arange(0, BLOCK_N)",
        f"in_range = (offs_q[:, None] < {m_dim}) & (offs_kv[None, :] < {n_dim})",
        f"attend = in_range & {_wrap(mask)}",
        "n_in = tl.sum(tl.sum(in_range.to(tl.int32), 1), 0)",
        "n_att = tl.sum(tl.sum(attend.to(tl.int32), 1), 0)",
        f"cls = tl.where(n_att == 0, {EMPTY}, tl.where((n_att == n_in) & ((j + 1) * BLOCK_N <= {n_dim}), {FULL}, {PARTIAL}))",
        "tl.store(bc_ptr + b * stride_bc_0 + h * stride_bc_1 + m * stride_bc_2 + j * stride_bc_3, cls.to(tl.int8))",
    ]
    return ["@triton.jit", f"def {name}(", *(f"    {a}," for a in args), "):", *(f"    {x}" for x in body), ""]


def _split_kernels(p: Program) -> list[Kernel]:
    """The kernels with a split-KV grid axis (an extent over NUM_SPLITS)."""
    return [k for k in p.kernels if any("NUM_SPLITS" in free_vars(a.extent) for a in k.grid)]


def packed_fn_name(k: Kernel) -> str:
    return f"_{k.name}_packed_kernel"


def _packing(p: Program, opts: LowerOptions, designs: DesignTable | None) -> dict[str, PackPlan] | str:
    """The kernels' pack plans when the module should carry packed forms (a split-KV program, or a design that
    packs), else why not: a prefill module whose designs never pack stays as it was."""
    split = bool(_split_kernels(p))
    if not opts.pack_gqa:
        return "the lowering was asked not to pack (LowerOptions.pack_gqa)"
    if not split and not any(d.pack_gqa for by in (designs or {}).values() for ds in by.values() for d in ds):
        return "not a split-KV program and no design packs"
    return pack_plans(p)


def check_attention_params(p: Program, lowering: str) -> None:
    """Both lowerings need q and k as [B, H, S, D] params and no varlen/paged index forms; KBError naming the lowering otherwise."""
    if constructs := serving_constructs(p):
        raise KBError(f"program {p.name}: the {lowering} lowering does not support {' or '.join(constructs)}; "
                      "lowering of varlen/paged programs is not supported yet (run them with kb.ir.interpret)")
    for name in ("q", "k"):
        try:
            prm = p.param(name)
        except KeyError:
            raise KBError(f"program {p.name}: the {lowering} lowering needs a param {name!r} [B, H, S, D]") from None
        if len(prm.shape) != 4:
            raise KBError(f"program {p.name}: {name} must be [B, H, S, D], got {prm.shape}")


def _design_lines(p: Program, designs: DesignTable | None, packs: dict | str) -> list[str]:
    """Module constants: the design table (per arch and head-dim bucket, best first) and the program's own schedule.

    A program that cannot pack lists its designs unpacked (deduplicated), so the table says what runs; a split-KV
    program that can pack verifies its packed form (its own schedule packs)."""
    packable = isinstance(packs, dict)

    def tuples(ds: tuple[Design, ...]) -> list[tuple]:
        return list(dict.fromkeys(d.as_tuple() if packable else dataclasses.replace(d, pack_gqa=False).as_tuple() for d in ds))

    table = {arch: {bucket: tuples(ds) for bucket, ds in sorted(by.items())} for arch, by in sorted((designs or {}).items())}
    split = bool(_split_kernels(p))
    own = Design.of_schedule(p.schedule, tma=True, pack_gqa=packable and split).as_tuple()
    return [f"PROGRAM = {p.name!r}",
            "# Designs per GPU arch and head-dim bucket, best first, chosen by kernel-kb from what its KB knew",
            "# (measured records, expert tunables): (BLOCK_M, BLOCK_N, NUM_SPLITS, num_warps, num_stages, tma, pack_gqa);",
            "# NUM_SPLITS 0 = chosen at launch from the grid and the SM count",
            f"# GQA packing: {'available (designs with pack_gqa run the packed kernels)' if packable else 'not used, ' + packs}",
            f"DESIGNS = {table!r}",
            "# the program's own schedule: run by the interpreter (and verified there), and timed on a GPU the table misses",
            f"PROGRAM_DESIGN = {own!r}", "", ""]


def _out_dtype(q: Param, first_in: Param) -> str:
    """The attention output (a tile tensor of q's rank, typed like q in the IR) follows the inputs' dtype at run
    time (bf16 in, bf16 out); any other declared dtype (the LSE's f32, a spec's deliberate fp32 output) is kept."""
    if q.dtype == first_in.dtype and len(q.shape) == len(first_in.shape):
        return f"{first_in.name}.dtype"
    return _TORCH_DTYPE[q.dtype]


@dataclass(frozen=True)
class HostEntry:
    """What a module's host function is: the forward's `forward` by default; kb.lower.triton_bwd makes `backward`
    (its own design chooser and block-class kernel, so it can sit in one module beside a forward)."""

    name: str = "forward"
    chooser: str = "_choose_design"  # picks the design per GPU and shape
    class_kernel: str = "_block_class_kernel"
    table_tag: str = ""  # leading entries of the block-table cache key (code), e.g. '"bwd", '
    zeroed: tuple[str, ...] = ()  # tensors allocated zero-filled (accumulated into)
    returns: tuple[str, ...] = ()  # the returned expressions; () = the OUT params
    table_helper: bool = True  # emit block_class_table()


def _host(p: Program, sig: _Signature, plan: BlockMaskPlan, packs: dict | str, entry: HostEntry = HostEntry()) -> list[str]:
    ins = [q for q in p.params if q.role is Role.IN]
    aux = [q for q in p.params if q.role is Role.AUX]
    outs = [q for q in p.params if q.role is Role.OUT]
    scratch = [q for q in p.params if q.role is Role.SCRATCH]
    scalars = [q for q in p.params if q.role is Role.SCALAR]
    names = {d: Sym(d, Kind.INT, True) for d in (*sig.dims, *SCHEDULE_CONSTANTS)}
    names.update({q.name: Sym(q.name, _KIND[q.dtype]) for q in scalars})
    hctx = ExprContext(ExprTarget.HOST, names)
    sig_text = ", ".join(q.name for q in ins) + ", *" + (", sm_scale=None" if any(q.name == "sm_scale" for q in scalars) else "")
    returned = ", ".join(entry.returns or tuple(q.name for q in outs))
    L = [f"def {entry.name}({sig_text}, _design=None, **aux_and_scalars):",
         f'    """Run `{p.name}`. Returns ({returned}). '
         f'Aux tensors: {", ".join(q.name for q in aux) or "none"}; scalars: {", ".join(q.name for q in scalars) or "none"}.',
         "    The design (tiles, warps, stages) is chosen per GPU and shape from DESIGNS; `_design=` forces one.\"\"\"",
         "    kw = dict(aux_and_scalars)"]
    for q in aux:
        L.append(f'    if "{q.name}" not in kw:')
        L.append(f'        raise ForwardArgumentError("{entry.name}() needs the aux tensor {q.name}={list(q.shape)}")')
        L.append(f'    {q.name} = kw.pop("{q.name}")')
    L.append("    dims = {}")
    for q in (*ins, *aux):
        L.append(f'    _bind(dims, "{q.name}", {q.name}, {tuple(q.shape)!r})')
    for d in sig.dims:
        L.append(f'    {d} = dims["{d}"]')
    for q in scalars:
        if q.name == "sm_scale":
            L.append(f"    sm_scale = 1.0 / math.sqrt({ins[0].name}.shape[-1]) if sm_scale is None else float(sm_scale)")
        else:
            L.append(f'    if "{q.name}" not in kw:')
            L.append(f'        raise ForwardArgumentError("{entry.name}() needs the scalar {q.name}=...")')
            L.append(f'    {q.name} = float(kw.pop("{q.name}"))')
    if sig.table:  # like FlexAttention's block mask: built once by the caller and passed back, or built here
        L.append('    block_class, only_table = kw.pop("block_class", None), kw.pop("_only_block_class", False)')
    L.append("    if kw:")
    L.append(f'        raise ForwardArgumentError(f"{entry.name}() got unexpected arguments: {{sorted(kw)}}")')
    L.append("")
    L.append("    def launch(design, table_only=False):")
    L += ["    " + line if line else line for line in _launch_body(p, sig, plan, hctx, names, ins, aux, outs, scratch, packs, entry)]
    L.append("")
    first = ins[0].name
    dims_key = ", ".join(sig.dims)
    d_dim = "D" if "D" in sig.dims else f"{first}.shape[-1]"
    L.append(f"    design = tuple(_design) if _design is not None else {entry.chooser}({first}, {d_dim}, "
             f"({first}.device, {first}.dtype, {dims_key}{',' if len(sig.dims) == 1 else ''}), launch)")
    if sig.table:
        L.append("    return launch(design, table_only=only_table)")
    else:
        L.append("    return launch(design)")
    if sig.table and entry.table_helper:
        L += ["", "", "def block_class_table(*args, **kw):",
              '    """(block classes, block lists) forward(*args, **kw) builds; pass it back as block_class= to reuse it."""',
              "    return forward(*args, _only_block_class=True, **kw)"]
    return L


def _grid_code(k: Kernel, hctx: ExprContext, pack: PackPlan | None, split: bool = True) -> str:
    """The host's launch-grid size of kernel `k` (packed: over KV heads and packed row blocks); without the
    split axes when `split` is False."""
    axes = [a for a in k.grid if split or "NUM_SPLITS" not in free_vars(a.extent)]
    return " * ".join(_wrap(lower_expr(pack.extent(a.name, a.extent) if pack else a.extent, hctx)) for a in axes) or "1"


def _launch_body(p: Program, sig: _Signature, plan: BlockMaskPlan, hctx: ExprContext, names: dict,
                 ins: list[Param], aux: list[Param], outs: list[Param], scratch: list[Param], packs: dict | str,
                 entry: HostEntry = HostEntry()) -> list[str]:
    """The body of the host's `launch(design)`: allocate outputs, build the block table, launch every kernel."""
    s = p.schedule
    scalars = [q for q in p.params if q.role is Role.SCALAR]
    L = ["    BLOCK_M, BLOCK_N, NUM_SPLITS, num_warps, num_stages, tma, PACK = _design7(design)"]
    if isinstance(packs, dict):
        pk = next(iter(packs.values()))
        hctx = ExprContext(hctx.target, {**hctx.names, PACK_ROWS: Sym("_PK_ROWS", Kind.INT, True)}, hctx.aux)
        L.append(f"    # GQA packing: the {pk.hq} // {pk.hkv} query heads of a KV head share a tile (K/V read once per KV head)")
        L.append(f"    PACK = PACK and {pk.hq} > {pk.hkv} and {pk.hq} % {pk.hkv} == 0")
        L.append(f"    _PK_ROWS = ({pk.hq} // {pk.hkv}) * {pk.m}")
    split_kernels = _split_kernels(p)
    if split_kernels:
        k0 = split_kernels[0]
        base = _grid_code(k0, hctx, None, split=False)
        if isinstance(packs, dict):
            base = f"({_grid_code(k0, hctx, packs[k0.name], split=False)} if PACK else {base})"
        L.append(f"    NUM_SPLITS = NUM_SPLITS or _auto_splits({base}, _hcdiv(N, BLOCK_N), {ins[0].name}.device)")
    else:
        L.append("    NUM_SPLITS = max(1, NUM_SPLITS)")
    head_pad = str(s.fixed_head_pad) if s.fixed_head_pad else f"max({DOT_MIN_K}, triton.next_power_of_2(D))"
    L.append(f"    HEAD_PAD = {head_pad}")
    if "D" in sig.dims:
        L.append("    if HEAD_PAD < D:")
        L.append('        raise ForwardArgumentError(f"schedule head_pad={HEAD_PAD} is smaller than the head dim D={D}")')
    for pad in sig.pads:
        L.append(f"    {pad} = triton.next_power_of_2({pad[4:]})")
    if VALUE_DIM in sig.dims:
        L.append(f"    HEAD_PAD_V = max({DOT_MIN_K}, triton.next_power_of_2({VALUE_DIM}))")
    if sig.even_d:
        L.append("    EVEN_D = HEAD_PAD == D")
    if sig.even_dv:
        L.append(f"    EVEN_DV = HEAD_PAD_V == {VALUE_DIM}")
    for name in sig.pos_scalars:
        L.append(f"    POS_{name} = {name} > 0")
    device = ins[0].name + ".device"
    table_args: list[str] = []
    if sig.table:
        assert p.mask_mod is not None
        qshape = p.param("q").shape
        nb = str(qshape[0]) if plan.per_b else "1"
        nh = str(qshape[1]) if plan.per_h else "1"
        L.append("    # block classes of mask_mod (not decidable in closed form): one GPU program per tile")
        used = sorted(free_vars(p.mask_mod.body) & {q.name for q in (*aux, *scalars)} | loaded_tensors(p.mask_mod.body))
        tensors_used = ", ".join(n for n in used if n in {q.name for q in aux})
        scalars_used = ", ".join(n for n in used if n in {q.name for q in scalars})
        cargs = ", ".join([q.name for q in aux] + [f"*{q.name}.stride()" for q in aux] + list(sig.dims)
                          + [q.name for q in scalars] + ["bc", "*bc.stride()", "*bc.shape[1:]"])
        L.append(f"    classes = lambda bc: {entry.class_kernel}[(bc.numel(),)]({cargs}, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)")
        L.append("    # rebuilt only when the mask's inputs change (compared by content), as FlexAttention's block mask is built once")
        L.append(f"    table = block_class if block_class is not None else _cached_table(({entry.table_tag}BLOCK_M, BLOCK_N, "
                 f"{', '.join(sig.dims)}, "
                 f"{scalars_used}{',' if scalars_used else ''}), ({tensors_used}{',' if tensors_used else ''}), "
                 f"lambda: _hblock_table(_hblock_classes(classes, {nb}, {nh}, {qshape[2]}, {p.param('k').shape[2]}, "
                 f"BLOCK_M, BLOCK_N, {device})))")
        L.append("    if table_only:")
        L.append("        return table")
        L.append("    bc, kvl = table")
        table_args = ["bc", "*bc.stride()", "*bc.shape", "kvl", "*kvl.stride()"]
    for q in (*outs, *scratch):
        shape = ", ".join(str(d) for d in q.shape)
        dtype = _out_dtype(q, ins[0]) if q.role is Role.OUT else _TORCH_DTYPE[q.dtype]
        alloc = "zeros" if q.name in entry.zeroed else "empty"
        L.append(f"    {q.name} = torch.{alloc}(({shape},), dtype={dtype}, device={device})")
    if sig.tma:
        tma_ts = ", ".join(sig.tma_tensors) + ("," if len(sig.tma_tensors) == 1 else "")
        L.append("    # Hopper: tile loads/stores through tensor descriptors (TMA) where the GPU and layouts allow")
        sides = "BLOCK_M, BLOCK_N, HEAD_PAD" + (", HEAD_PAD_V" if VALUE_DIM in sig.dims else "")
        L.append(f"    USE_TMA = tma and _use_tma(({tma_ts}), ({sides}))")
    if sig.ws:
        L.append(f"    WARP_SPEC = USE_TMA and {bool(s.warp_specialize)}")
    args = [q.name for q in sig.tensors] + [f"*{q.name}.stride()" for q in sig.tensors] + list(sig.dims) \
        + [q.name for q in sig.scalars] + table_args
    const_kw = ", ".join(f"{c}={c}" for c in sig.constexprs())
    for k in p.kernels:
        launches = [(kernel_fn_name(k), _grid_code(k, hctx, None))]
        if isinstance(packs, dict):
            launches.insert(0, (packed_fn_name(k), _grid_code(k, hctx, packs[k.name])))
        for i, (fn, grid) in enumerate(launches):
            indent = "        " if len(launches) > 1 else "    "
            if len(launches) > 1:
                L.append("    if PACK:" if i == 0 else "    else:")
            L.append(f"{indent}{fn}[({grid},)](")
            L.append(f"{indent}    {', '.join(args)},")
            L.append(f"{indent}    {const_kw}, num_warps=num_warps, num_stages=num_stages,")
            L.append(f"{indent})")
    L.append(f"    return {', '.join(entry.returns or tuple(q.name for q in outs))}")
    return L
