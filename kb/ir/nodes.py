"""The tile-level attention IR: a Program of kernels over tiles.

Every node is a frozen dataclass; statements carry a class-level `op: StmtOp`
(the legal statement kinds are exactly `StmtOp`). Nodes are changed through
`dataclasses.replace`; passes are plain functions `Program -> Program`.

Semantics (the reference interpreter in `kb.ir.interpret` is the executable form):
- A Program has typed tensor params with symbolic shapes, a Schedule, optional
  `score_mod` / `mask_mod` variant functions and one or more kernels run in order.
- A Kernel runs its body once per point of its grid; grid axes bind scalar names.
- Scalars (grid vars, `let`, loop vars) are ints; symbolic dims (B, Hq, Hkv, M, N, D, ...)
  and schedule constants (BLOCK_M, BLOCK_N, NUM_SPLITS, HEAD_PAD, HEAD_PAD_V) are ints known at launch.
- Value head dim: v, o (and split-KV o partials) may end in their own dim `Dv` (MLA-style value
  heads, D_v != D_qk); their `:` tiles and the accumulator are HEAD_PAD_V wide. A program without
  `Dv` has one head dim D, and HEAD_PAD_V = HEAD_PAD there.
- Tiles are named values (2-D or 1-D) produced by load/init/dot/elementwise/reduce/
  online_softmax/finalize/combine and consumed by later statements.
- `load` reads out-of-range elements as `other` (0 by default); `store` writes only in-range
  elements. An element is in range when every index item puts it inside its dim's extent,
  a `Span` with `until` also below `until`, and a `Gather` lane also has `valid` true.
- Token-major (serving) layouts: q, k, v, o as [T, H, D] with all sequences concatenated;
  per-sequence offsets and lengths come from aux loads in `let`s, and a `Span`'s `until`
  (e.g. `q0 + m_start:+BLOCK_M until q0 + q_len`) stops a tile at its sequence's end (varlen).
  A paged KV cache is addressed by a scalar index that loads the page table
  (`k[block_table[b, n // PAGE], n % PAGE:+BLOCK_N, hk, :]`, the tile inside one page) or by a
  `Gather` axis, one table lookup per lane (`[req_to_token[b, n + j] for j in range(BLOCK_N) if ...]`).
- `mask` sets disallowed scores to -inf: `kv_idx < N` (ragged last block) when the program has
  a dim N, plus `mask_mod` when `use_mask_mod`. A program without a dim N (token-major or
  paged: no [.., N, D] k) has no built-in bound; its per-sequence bound is in its mask_mod
  (`kv_idx < kv_lens[b]`) or its loop bounds and loads. q rows beyond M (when M is a dim) are
  never stored; without M the store's `until` decides. Mask and block coordinates
  (`at (b, h, q_start, kv_start)`) are whatever the program passes, sequence-local for varlen.
- `online_softmax` keeps the FlashAttention running state (row max m, row sum l,
  accumulator acc) in natural-log space; `finalize` gives o = acc / l and
  lse = m + log(l). A fully masked row (l == 0) gives o = 0 and lse = -inf (no NaN).
- `combine` merges split-KV partials (o_s, lse_s) along the split axis:
  lse = logsumexp_s(lse_s); o = sum_s exp(lse_s - lse) * o_s (0 where lse = -inf).
- Block classes (`if block(...) is full`) are computed from mask_mod over the
  in-range part of the (BLOCK_M x BLOCK_N) tile at (q_start, kv_start):
  full = every in-range pair attends and the tile is not ragged in kv;
  empty = no pair attends; partial = otherwise. Without a dim M (N) the rows (columns) are
  unbounded above, so only mask_mod can make a tile partial or empty.

Backward programs (same model; `is_backward`): inputs q, k, v, o, dout (dO), lse (saved by the
forward, natural log); outputs dq, dk, dv (and the gradient of a learnable aux table).
- `probs p = exp(s - lse)` recomputes P from the saved lse (0 where masked or the row is empty);
- `softmax_grad ds = p * (dp - delta)` with dp = dO @ V^T and delta = rowsum(dO * O);
- `score_mod_grad ds wrt s at (...)` multiplies by the derivative of score_mod w.r.t. its score
  (derived symbolically from the variant expression, `kb.ir.derive`);
- `aux_grad` scatters the gradient of an aux tensor that score_mod reads (a learnable bias table);
- `dot` takes `trans(a)` (dV += P^T dO, dK += dS^T Q); `store ... += x` accumulates (dq across
  KV blocks, GQA reductions), and accumulated tensors start zero-filled.
Tiles keep the forward's [rows = q, cols = kv] orientation in both loop orders.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Iterator, Union

from kb.ir.algebra import next_pow2
from kb.ir.expr import Expr

__all__ = [
    "Dtype", "Role", "Param", "Schedule", "GridAxis", "VariantFn", "Span", "Full", "Gather", "Index", "TileAt",
    "StmtOp", "BACKWARD_OPS", "BlockClass", "Let", "Load", "Store", "Init", "Dot", "Elementwise", "Reduce",
    "ScoreMod", "Mask", "OnlineSoftmax", "Finalize", "Combine", "For", "IfBlock", "Probs", "SoftmaxGrad",
    "ScoreModGrad", "AuxGrad", "Stmt", "accumulated_tensors", "aux_gradients", "is_backward",
    "Kernel", "Program", "SCORE_MOD_PARAMS", "MASK_MOD_PARAMS", "SCHEDULE_CONSTANTS", "DOT_MIN_K", "VALUE_DIM", "walk_stmts",
    "launch_constants", "serving_constructs", "index_exprs",
]


class Dtype(Enum):
    F32 = "f32"
    BF16 = "bf16"
    F16 = "f16"
    I32 = "i32"
    I64 = "i64"
    BOOL = "bool"


class Role(Enum):
    IN = "in"  # attention inputs (q, k, v)
    OUT = "out"  # written by the program (o, lse)
    AUX = "aux"  # auxiliary tensors read by variant functions (slopes, doc ids, bias tables)
    SCALAR = "scalar"  # a runtime scalar (sm_scale, softcap, window)
    SCRATCH = "scratch"  # intermediate buffers the launcher allocates (split-KV partials)


Dim = Union[str, int]


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[Dim, ...]  # () for scalars
    dtype: Dtype
    role: Role


@dataclass(frozen=True)
class Schedule:
    """How the program is tiled and launched; names below are visible in expressions."""

    block_m: int = 64  # BLOCK_M
    block_n: int = 64  # BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    head_pad: int = 0  # HEAD_PAD: padded head dim (power of two); 0 = chosen per launch (head_pad_for)
    kv_order: str = "forward"  # "forward" | "reverse" iteration over KV blocks
    num_splits: int = 1  # NUM_SPLITS for split-KV programs
    warp_specialize: bool = False  # hint carried from Hopper/Blackwell references

    def tile_constants(self) -> dict[str, int]:
        """BLOCK_M, BLOCK_N and NUM_SPLITS: the schedule constants every launch fixes (the head pads may not be)."""
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "NUM_SPLITS": self.num_splits}

    @property
    def fixed_head_pad(self) -> int | None:
        """HEAD_PAD when the schedule fixes it; None when each launch picks it from D (`head_pad_for`)."""
        return self.head_pad or None

    def head_pad_for(self, d: int, floor: int = 1) -> int:
        """HEAD_PAD at head dim `d`: the schedule's head_pad, else the next power of two >= d, at least `floor`
        (the interpreter pads to 1, the lowerings to DOT_MIN_K)."""
        return self.head_pad or max(floor, next_pow2(d))

    def value_head_pad_for(self, dv: int, floor: int = 1) -> int:
        """HEAD_PAD_V at value head dim `dv` (no schedule field fixes it): the next power of two >= dv, at least `floor`."""
        return max(floor, next_pow2(dv))


SCHEDULE_CONSTANTS = ("BLOCK_M", "BLOCK_N", "NUM_SPLITS", "HEAD_PAD", "HEAD_PAD_V")
DOT_MIN_K = 16  # the lowerings pad head dims to at least this: `tl.dot` and mma tiles need K >= 16
VALUE_DIM = "Dv"  # the value head dim of v and o when it differs from q/k's D; padded to HEAD_PAD_V
SCORE_MOD_PARAMS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_MOD_PARAMS = ("b", "h", "q_idx", "kv_idx")


@dataclass(frozen=True)
class GridAxis:
    name: str
    extent: Expr


@dataclass(frozen=True)
class VariantFn:
    """`score_mod(score, b, h, q_idx, kv_idx) = body` or `mask_mod(b, h, q_idx, kv_idx) = body`."""

    kind: str  # "score_mod" | "mask_mod"
    params: tuple[str, ...]
    body: Expr


@dataclass(frozen=True)
class Span:
    """`start:+size [until END]` along one tensor dim: `size` elements from `start`.

    Element i (tensor index start + i) is in range iff 0 <= start + i < the dim's extent and,
    with `until`, start + i < until (an integer scalar: the end of a varlen sequence)."""

    start: Expr
    size: Dim  # a schedule constant name (BLOCK_M, BLOCK_N, HEAD_PAD, HEAD_PAD_V) or an int
    until: Expr | None = None


@dataclass(frozen=True)
class Full:
    """`:` — the whole dim (padded to HEAD_PAD for D, HEAD_PAD_V for Dv, to a power of two otherwise)."""


@dataclass(frozen=True)
class Gather:
    """`[index for var in range(size) if valid]` — a gathered tile axis of `size` lanes.

    Lane j (bound to `var`, 0 <= j < size) reads tensor index `index` (an integer Expr over `var`
    and scalars, typically a table load `req_to_token[b, n_start + j]`). A lane is in range iff
    `valid` (a boolean Expr over `var` and scalars; None = always) holds and 0 <= index < the
    dim's extent; other lanes read `other` and are not stored. Table loads in `index` are clamped
    for invalid lanes, never out of bounds; a valid lane (and `valid` itself) must load in range."""

    var: str
    size: Dim  # a schedule constant name or an int, as for Span
    index: Expr
    valid: Expr | None = None


Index = Union[Expr, Span, Full, Gather]


@dataclass(frozen=True)
class TileAt:
    """`(b, h, q_start, kv_start)` — where a BLOCK_M x BLOCK_N score tile sits: its batch and head and the
    first query row and key column, so element (i, j) has q_idx = q_start + i and kv_idx = kv_start + j.
    Carried by score_mod, mask, `if block(...)`, score_mod_grad and aux_grad; iterating gives the four in order.

    `head_rows` (text `at (b, heads h, q, kv)`, score_mod and mask only): the tile's rows are query heads of one query
    position, as in a decode kernel that packs a GQA group into its rows (vLLM's and SGLang's grouped decode): element
    (i, j) has head h + i, q_idx = q_start and kv_idx = kv_start + j."""

    b: Expr
    h: Expr
    q_start: Expr
    kv_start: Expr
    head_rows: bool = False

    def __iter__(self) -> Iterator[Expr]:
        return iter((self.b, self.h, self.q_start, self.kv_start))


class StmtOp(Enum):
    LET = "let"
    LOAD = "load"
    STORE = "store"
    INIT = "init"
    DOT = "dot"
    ELEMENTWISE = "elementwise"
    REDUCE = "reduce"
    SCORE_MOD = "score_mod"
    MASK = "mask"
    ONLINE_SOFTMAX = "online_softmax"
    FINALIZE = "finalize"
    COMBINE = "combine"
    FOR = "for"
    IF_BLOCK = "if"
    # backward (see "Backward programs" in the module docstring)
    PROBS = "probs"
    SOFTMAX_GRAD = "softmax_grad"
    SCORE_MOD_GRAD = "score_mod_grad"
    AUX_GRAD = "aux_grad"


BACKWARD_OPS = frozenset({StmtOp.PROBS, StmtOp.SOFTMAX_GRAD, StmtOp.SCORE_MOD_GRAD, StmtOp.AUX_GRAD})


class BlockClass(Enum):
    FULL = "full"
    PARTIAL = "partial"
    EMPTY = "empty"


@dataclass(frozen=True)
class Let:
    """`let name = value` — a scalar."""

    op: ClassVar[StmtOp] = StmtOp.LET
    name: str
    value: Expr


@dataclass(frozen=True)
class Load:
    """`load out = tensor[index...] [other X]` — a tile; out-of-range elements read `other`."""

    op: ClassVar[StmtOp] = StmtOp.LOAD
    out: str
    tensor: str
    index: tuple[Index, ...]
    other: float = 0.0  # value of out-of-range elements (-inf for split-KV lse partials)


@dataclass(frozen=True)
class Store:
    """`store tensor[index...] = value` — in-range elements only, cast to the tensor dtype.

    `store tensor[index...] += value` (accumulate) adds instead (atomically where programs run
    in parallel); a tensor any accumulating store targets starts zero-filled, not poisoned."""

    op: ClassVar[StmtOp] = StmtOp.STORE
    tensor: str
    index: tuple[Index, ...]
    value: str
    accumulate: bool = False


@dataclass(frozen=True)
class Init:
    """`init out = full(shape; fill) dtype` — shape entries are dims/constants; fill is a number, or a scalar
    expression of the kernel's scalars and aux loads (`full(BLOCK_M; sinks[h])`: attention sinks start the
    online softmax's running max at the sink logit, with l = 1 and acc = 0). A constant fill is a number, never
    a CONST expression (one spelling per program)."""

    op: ClassVar[StmtOp] = StmtOp.INIT
    out: str
    shape: tuple[Dim, ...]
    fill: float | Expr
    dtype: Dtype


@dataclass(frozen=True)
class Dot:
    """`dot out = a @ b`, `a @ trans(b)`, `trans(a) @ b` — fp32 accumulation."""

    op: ClassVar[StmtOp] = StmtOp.DOT
    out: str
    a: str
    b: str
    trans_b: bool
    trans_a: bool = False


@dataclass(frozen=True)
class Elementwise:
    """`elementwise out = value` — value's VARs name tiles (same shape) or scalars."""

    op: ClassVar[StmtOp] = StmtOp.ELEMENTWISE
    out: str
    value: Expr


@dataclass(frozen=True)
class Reduce:
    """`reduce out = max(src, axis)` / `sum(src, axis)`."""

    op: ClassVar[StmtOp] = StmtOp.REDUCE
    out: str
    kind: str  # "max" | "sum"
    src: str
    axis: int


@dataclass(frozen=True)
class ScoreMod:
    """`score_mod tile at (b, h, q_start, kv_start)` — applies the program's score_mod in place."""

    op: ClassVar[StmtOp] = StmtOp.SCORE_MOD
    tile: str
    at: TileAt


@dataclass(frozen=True)
class Mask:
    """`mask tile at (b, h, q_start, kv_start) [bounds|mask_mod]` — disallowed scores become -inf."""

    op: ClassVar[StmtOp] = StmtOp.MASK
    tile: str
    at: TileAt
    use_mask_mod: bool


@dataclass(frozen=True)
class OnlineSoftmax:
    """`online_softmax (m, l, acc) += scores @ values` — one FlashAttention update step."""

    op: ClassVar[StmtOp] = StmtOp.ONLINE_SOFTMAX
    m: str
    l: str
    acc: str
    scores: str
    values: str


@dataclass(frozen=True)
class Finalize:
    """`finalize o, lse = (m, l, acc)`."""

    op: ClassVar[StmtOp] = StmtOp.FINALIZE
    o: str
    lse: str
    m: str
    l: str
    acc: str


@dataclass(frozen=True)
class Combine:
    """`combine o, lse = (o_parts, lse_parts)` — parts stacked along axis 0 (the split axis)."""

    op: ClassVar[StmtOp] = StmtOp.COMBINE
    o: str
    lse: str
    o_parts: str
    lse_parts: str


@dataclass(frozen=True)
class For:
    """`for var in range(lo, hi, step) order:` — var takes lo, lo+step, ... < hi (reversed if order == reverse)."""

    op: ClassVar[StmtOp] = StmtOp.FOR
    var: str
    lo: Expr
    hi: Expr
    step: Dim
    order: str
    body: tuple["Stmt", ...]


@dataclass(frozen=True)
class IfBlock:
    """`if block(b, h, q_start, kv_start) is [not] CLASS:` then / else."""

    op: ClassVar[StmtOp] = StmtOp.IF_BLOCK
    cls: BlockClass
    negate: bool
    at: TileAt
    then: tuple["Stmt", ...]
    orelse: tuple["Stmt", ...] = ()


@dataclass(frozen=True)
class Probs:
    """`probs p = exp(s - lse)` — recomputed probabilities: p[i, j] = exp(s[i, j] - lse[i]),
    0 where s[i, j] or lse[i] is -inf (masked scores, fully masked rows)."""

    op: ClassVar[StmtOp] = StmtOp.PROBS
    out: str
    scores: str
    lse: str


@dataclass(frozen=True)
class SoftmaxGrad:
    """`softmax_grad ds = p * (dp - delta)` — ds[i, j] = p[i, j] * (dp[i, j] - delta[i])."""

    op: ClassVar[StmtOp] = StmtOp.SOFTMAX_GRAD
    out: str
    p: str
    dp: str
    delta: str


@dataclass(frozen=True)
class ScoreModGrad:
    """`score_mod_grad ds wrt s at (b, h, q_start, kv_start)` — ds *= d score_mod / d score,
    evaluated at score = s[i, j] (the score_mod input), q_idx = q_start + i, kv_idx = kv_start + j."""

    op: ClassVar[StmtOp] = StmtOp.SCORE_MOD_GRAD
    tile: str
    scores: str
    at: TileAt


@dataclass(frozen=True)
class AuxGrad:
    """`aux_grad grad of aux += ds wrt s [centred lse] at (b, h, q_start, kv_start)` — the gradient of an
    aux tensor read by score_mod: for each load `aux[idx...]` in score_mod and each in-range (i, j),
    grad[idx] += ds[i, j] * d score_mod / d aux[idx] at (s[i, j], coords). `grad` has aux's shape
    and starts zero-filled (it is accumulated into, like a `+=` store).

    `centred lse` (the row vector probs read): for a load whose index is the same along a row, the
    partial minus its row centre c[i] (`kb.ir.derive.row_centre`, at lse[i]) is added instead. The sum
    is the same, since every row of ds sums to 0 (softmax is shift invariant), but a partial that
    carries the row's large common score (a temperature's: s itself) no longer multiplies the rounding
    of ds's row sums."""

    op: ClassVar[StmtOp] = StmtOp.AUX_GRAD
    grad: str
    aux: str
    tile: str
    scores: str
    at: TileAt
    lse: str | None = None


Stmt = Union[Let, Load, Store, Init, Dot, Elementwise, Reduce, ScoreMod, Mask, OnlineSoftmax, Finalize, Combine, For, IfBlock,
             Probs, SoftmaxGrad, ScoreModGrad, AuxGrad]


def walk_stmts(body: tuple[Stmt, ...]) -> Iterator[Stmt]:
    """Every statement of `body` in pre-order: a For before its body, an IfBlock before `then`, then `orelse`."""
    for st in body:
        yield st
        if isinstance(st, For):
            yield from walk_stmts(st.body)
        elif isinstance(st, IfBlock):
            yield from walk_stmts(st.then)
            yield from walk_stmts(st.orelse)


@dataclass(frozen=True)
class Kernel:
    name: str
    grid: tuple[GridAxis, ...]
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class Program:
    name: str
    params: tuple[Param, ...]
    schedule: Schedule
    kernels: tuple[Kernel, ...]
    score_mod: VariantFn | None = None
    mask_mod: VariantFn | None = None

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def dims(self) -> tuple[str, ...]:
        """Symbolic dim names in first-use order."""
        seen: dict[str, None] = {}
        for p in self.params:
            for d in p.shape:
                if isinstance(d, str):
                    seen.setdefault(d, None)
        return tuple(seen)


def index_exprs(st: Load | Store) -> Iterator[Expr]:
    """The integer expressions that index `st`: spans' starts and `until`s, gathered axes' lane indices, plain ones."""
    for ix in st.index:
        if isinstance(ix, Span):
            yield ix.start
            if ix.until is not None:
                yield ix.until
        elif isinstance(ix, Gather):
            yield ix.index
        elif not isinstance(ix, Full):
            yield ix


def serving_constructs(p: Program) -> tuple[str, ...]:
    """The varlen/paged index forms `p` uses, each with its tensors: "`until` (on q, k)", "a gathered axis (on k, v)"."""
    found: dict[str, dict[str, None]] = {}
    for k in p.kernels:
        for st in walk_stmts(k.body):
            if not isinstance(st, (Load, Store)):
                continue
            for ix in st.index:
                if isinstance(ix, Span) and ix.until is not None:
                    found.setdefault("`until`", {})[st.tensor] = None
                elif isinstance(ix, Gather):
                    found.setdefault("a gathered axis", {})[st.tensor] = None
    return tuple(f"{kind} (on {', '.join(tensors)})" for kind, tensors in found.items())


def accumulated_tensors(p: Program) -> tuple[str, ...]:
    """Tensors some `+=` store or `aux_grad` accumulates into: they start zero-filled."""
    found: dict[str, None] = {}
    for k in p.kernels:
        for st in walk_stmts(k.body):
            if isinstance(st, Store) and st.accumulate:
                found[st.tensor] = None
            elif isinstance(st, AuxGrad):
                found[st.grad] = None
    return tuple(found)


def aux_gradients(p: Program) -> dict[str, str]:
    """{gradient param: aux tensor} of a backward program's `aux_grad` statements, in the program's param order."""
    pairs = {st.grad: st.aux for k in p.kernels for st in walk_stmts(k.body) if isinstance(st, AuxGrad)}
    return {q.name: pairs[q.name] for q in p.params if q.name in pairs}


def is_backward(p: Program) -> bool:
    """A backward program recomputes probabilities from a saved lse (it has a `probs` statement)."""
    return any(isinstance(st, Probs) for k in p.kernels for st in walk_stmts(k.body))


def launch_constants(p: Program) -> tuple[str, ...]:
    """The schedule constants a lowering passes to `p`'s kernels: HEAD_PAD_V only when `p` has a `Dv`."""
    return tuple(c for c in SCHEDULE_CONSTANTS if c != "HEAD_PAD_V" or VALUE_DIM in p.dims())
