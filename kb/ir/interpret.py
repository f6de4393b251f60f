"""The reference interpreter: executes a Program on CPU torch tensors with its tile semantics.

This is the executable definition of the semantics in `kb.ir.nodes` (see its docstring). It is
slow (one Python step per statement per grid point) and exact:
- symbolic dims are bound from the input tensors (every occurrence must agree), schedule
  constants BLOCK_M, BLOCK_N, NUM_SPLITS, HEAD_PAD (0 -> next power of two >= D) are bound from
  the Schedule, HEAD_PAD_V is the next power of two >= Dv (HEAD_PAD without a `Dv`), and `shapes=` may bind dims no input carries;
- OUT and SCRATCH params are allocated in their dtype and poisoned (NaN; int min; True), so an
  element no kernel stores is visible in the result;
- kernels run in order, each over the product of its grid axes (first axis outermost);
- loads pad with `other`, stores write in-range elements only (cast to the param dtype), dots
  accumulate in fp32 with inputs upcast (no TF32), `online_softmax`/`finalize`/`combine` follow
  `kb.ir.interp_softmax`, variant functions and block classes follow `kb.ir.interp_variants`;
- scalars and tiles share one flat namespace per grid point (a loop or if body assigns into it).

Statistics (`RunStats`) count what the block loops really did, so tests can check that block
skipping skips: a loop whose step is `BLOCK_N` is a KV-block loop; `kv_blocks_dense` is what it
would visit over all of [0, N) (cdiv(N, BLOCK_N) per loop entry; a program without a dim N
counts the loop's own visits). Loads and stores honour `until` and gathered axes (`kb.ir.interp_tiles`);
a program without a dim M or N has no built-in bound there (`kb.ir.nodes`).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from kb.errors import KBError
from kb.ir.evaluate import Value, eval_expr
from kb.ir.expr import Expr
from kb.ir.interp_softmax import combine, finalize, online_softmax_step
from kb.ir.derive import ROW_LSE, aux_partials, row_centre, score_grad
from kb.ir.interp_softmax import probs, softmax_grad
from kb.ir.interp_tiles import TORCH_DTYPES, TileIndex, gather, resolve_dim, scatter, scatter_add, tile_index
from kb.ir.interp_variants import (
    UNBOUNDED, ClampedAux, TileCoords, classify_block, eval_over_tile, eval_variant, mask_tile,
)
from kb.ir.nodes import (
    AuxGrad, BlockClass, Combine, Dot, Dtype, Elementwise, Finalize, For, Gather, IfBlock, Index, Init, Kernel, Let, Load,
    Mask, OnlineSoftmax, Param, Probs, Program, Reduce, Role, ScoreMod, ScoreModGrad, SoftmaxGrad, Stmt,
    Store, SCHEDULE_CONSTANTS, VALUE_DIM, accumulated_tensors,
)
from kb.ir.text import print_stmt_header
from kb.ir.visit import StmtVisitor

__all__ = ["KernelStats", "RunStats", "RunResult", "bind_dims", "interpret", "run_program"]

log = logging.getLogger(__name__)

Inputs = Mapping[str, "torch.Tensor | float | int"]


@dataclass(frozen=True)
class KernelStats:
    """What one kernel did over its whole grid."""

    name: str
    grid_points: int
    kv_loops: int  # entries into a loop stepping by BLOCK_N
    kv_blocks_visited: int  # iterations of those loops
    kv_blocks_dense: int  # cdiv(N, BLOCK_N) per loop entry: the visits with no block skipping
    full_blocks: int  # outcomes of `if block(...)` tests
    partial_blocks: int
    empty_blocks: int
    masks_applied: int  # `mask` statements executed
    elements_stored: int

    @property
    def kv_blocks_skipped(self) -> int:
        return self.kv_blocks_dense - self.kv_blocks_visited


@dataclass(frozen=True)
class RunStats:
    kernels: tuple[KernelStats, ...]

    def kernel(self, name: str) -> KernelStats:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)


@dataclass(frozen=True)
class RunResult:
    outputs: dict[str, torch.Tensor]  # OUT params by name, in their declared dtype
    stats: RunStats
    dims: dict[str, int]  # every bound dim and schedule constant


def run_program(p: Program, inputs: Inputs, *, shapes: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Execute `p`; returns its OUT params. Inputs: IN/AUX tensors and SCALAR values by name."""
    return interpret(p, inputs, shapes=shapes).outputs


def interpret(p: Program, inputs: Inputs, *, shapes: Mapping[str, int] | None = None) -> RunResult:
    """Execute `p` and return outputs with execution statistics."""
    dims = bind_dims(p, inputs, shapes)
    tensors, scalars = _take_inputs(p, inputs)
    zeroed = accumulated_tensors(p)
    for prm in p.params:
        if prm.role in (Role.OUT, Role.SCRATCH):
            tensors[prm.name] = _zeros(prm, dims) if prm.name in zeroed else _poisoned(prm, dims)
    with torch.no_grad():
        stats = tuple(_Machine(p, k, dims, scalars, tensors).run() for k in p.kernels)
    outputs = {prm.name: tensors[prm.name] for prm in p.params if prm.role is Role.OUT}
    return RunResult(outputs, RunStats(stats), dims)


# ---------------------------------------------------------------- binding


def bind_dims(p: Program, inputs: Inputs, shapes: Mapping[str, int] | None = None) -> dict[str, int]:
    """Dims and schedule constants; KBError when inputs disagree or a needed dim is unknown."""
    s = p.schedule
    dims: dict[str, int] = s.tile_constants()
    source: dict[str, str] = {k: "the schedule" for k in dims}

    def bind(name: str, value: int, where: str) -> None:
        if name in dims and dims[name] != value:
            raise KBError(f"dim {name} is {dims[name]} from {source[name]} but {value} from {where}; "
                          "make the input shapes agree")
        dims.setdefault(name, value)
        source.setdefault(name, where)

    for name, value in (shapes or {}).items():
        bind(name, int(value), "shapes=")
    for prm in p.params:
        if prm.role not in (Role.IN, Role.AUX):
            continue
        t = inputs.get(prm.name)
        if not isinstance(t, torch.Tensor):
            raise KBError(f"input {prm.name!r} ({prm.role.value}) must be a tensor of shape {list(prm.shape)}")
        if t.dim() != len(prm.shape):
            raise KBError(f"input {prm.name} has {t.dim()} dims {list(t.shape)}, the program declares {list(prm.shape)}")
        for d, n in zip(prm.shape, t.shape):
            if isinstance(d, int):
                if d != n:
                    raise KBError(f"input {prm.name} has size {n} where the program declares {d}")
            else:
                bind(d, int(n), f"{prm.name}.shape")
    dims["HEAD_PAD"] = s.head_pad_for(dims.get("D", 0))
    dims["HEAD_PAD_V"] = s.value_head_pad_for(dims[VALUE_DIM]) if VALUE_DIM in dims else dims["HEAD_PAD"]
    missing = sorted({d for prm in p.params for d in prm.shape if isinstance(d, str) and d not in dims})
    if missing:
        raise KBError(f"dims {', '.join(missing)} are not given by any input; pass them as shapes={{...}}")
    return dims


def _take_inputs(p: Program, inputs: Inputs) -> tuple[dict[str, torch.Tensor], dict[str, Value]]:
    declared = {prm.name: prm for prm in p.params}
    unknown = sorted(set(inputs) - {n for n, prm in declared.items() if prm.role in (Role.IN, Role.AUX, Role.SCALAR)})
    if unknown:
        raise KBError(f"inputs {', '.join(unknown)} are not input/aux/scalar params of program {p.name}")
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Value] = {}
    for prm in p.params:
        if prm.role in (Role.IN, Role.AUX):
            t = inputs[prm.name]
            assert isinstance(t, torch.Tensor), "bind_dims checks every IN/AUX input is a tensor"
            tensors[prm.name] = _checked_tensor(prm, t)
        elif prm.role is Role.SCALAR:
            scalars[prm.name] = _checked_scalar(prm, inputs.get(prm.name))
    return tensors, scalars


def _checked_tensor(prm: Param, t: torch.Tensor) -> torch.Tensor:
    want = TORCH_DTYPES[prm.dtype]
    if t.dtype == want:
        return t
    if prm.role is Role.AUX and _kind(t.dtype) == _kind(want):
        return t.to(want)  # aux index/bias tables: same kind, any width
    raise KBError(f"input {prm.name} is {t.dtype} but the program declares {prm.dtype.value}; cast the input")


def _kind(dt: torch.dtype) -> str:
    return "bool" if dt == torch.bool else "float" if dt.is_floating_point else "int"


def _checked_scalar(prm: Param, x: object) -> Value:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise KBError(f"scalar {prm.name} must be given as a number, got {type(x).__name__}")
    if prm.dtype in (Dtype.I32, Dtype.I64):
        if x != int(x):
            raise KBError(f"scalar {prm.name} is declared {prm.dtype.value} but got {x}")
        return int(x)
    return float(x)


def _zeros(prm: Param, dims: Mapping[str, int]) -> torch.Tensor:
    return torch.zeros([resolve_dim(d, dims) for d in prm.shape], dtype=TORCH_DTYPES[prm.dtype])


def _poisoned(prm: Param, dims: Mapping[str, int]) -> torch.Tensor:
    dt = TORCH_DTYPES[prm.dtype]
    shape = [resolve_dim(d, dims) for d in prm.shape]
    if dt.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dt)
    if dt == torch.bool:
        return torch.ones(shape, dtype=dt)
    return torch.full(shape, torch.iinfo(dt).min, dtype=dt)


# ---------------------------------------------------------------- execution


class _LocatedError(KBError):
    """A KBError already prefixed with the kernel, grid point and statement it came from."""


@dataclass
class _Counters:
    grid_points: int = 0
    kv_loops: int = 0
    kv_blocks_visited: int = 0
    kv_blocks_dense: int = 0
    classes: dict[BlockClass, int] = field(default_factory=lambda: {c: 0 for c in BlockClass})
    masks_applied: int = 0
    elements_stored: int = 0


class _Machine(StmtVisitor[None]):
    """Runs one kernel over its grid; `env` is the flat namespace of the current grid point."""

    def __init__(self, p: Program, k: Kernel, dims: dict[str, int], scalars: dict[str, Value],
                 tensors: dict[str, torch.Tensor]) -> None:
        self.p, self.k, self.dims, self.tensors = p, k, dims, tensors
        self.base: dict[str, Value] = {**dims, **scalars}
        # variant functions see dims and scalar params, not schedule constants or tiles
        self.variant_env: dict[str, Value] = {**{d: n for d, n in dims.items() if d not in SCHEDULE_CONSTANTS}, **scalars}
        self.aux = {prm.name: tensors[prm.name] for prm in p.params if prm.role is Role.AUX}
        self.env: dict[str, Value] = {}
        self.point: dict[str, int] = {}
        self.c = _Counters()

    def run(self) -> KernelStats:
        self.env = dict(self.base)
        extents = [self._int(ax.extent, f"grid axis {ax.name}") for ax in self.k.grid]
        for point in itertools.product(*(range(max(e, 0)) for e in extents)):
            self.point = {ax.name: i for ax, i in zip(self.k.grid, point)}
            self.env = {**self.base, **self.point}
            self.c.grid_points += 1
            self._block(self.k.body)
        c = self.c
        log.debug("kernel %s: %d grid points, %d/%d kv blocks", self.k.name, c.grid_points,
                  c.kv_blocks_visited, c.kv_blocks_dense)
        return KernelStats(self.k.name, c.grid_points, c.kv_loops, c.kv_blocks_visited, c.kv_blocks_dense,
                           c.classes[BlockClass.FULL], c.classes[BlockClass.PARTIAL], c.classes[BlockClass.EMPTY],
                           c.masks_applied, c.elements_stored)

    def _block(self, body: tuple[Stmt, ...]) -> None:
        for st in body:
            try:
                self.visit(st)
            except _LocatedError:
                raise
            except (KBError, RuntimeError, IndexError, ZeroDivisionError, ValueError) as err:
                where = ", ".join(f"{k}={v}" for k, v in self.point.items())
                raise _LocatedError(f"kernel {self.k.name} at ({where}), `{print_stmt_header(st)}`: {err}") from err

    # -- helpers

    def _eval(self, e: Expr) -> Value:
        return eval_expr(e, self.env, self.aux)

    def _int(self, e: Expr, what: str) -> int:
        v = eval_expr(e, self.env, self.aux)
        if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
            v = int(v.item())
        if not isinstance(v, int) or isinstance(v, bool):
            raise KBError(f"{what} = {e} must be an integer scalar, got {v!r}")
        return v

    def _bound(self, name: str) -> int:
        """The extent of dim M or N; unbounded when the program has none (token-major, paged)."""
        return self.dims.get(name, UNBOUNDED)

    def _tile(self, name: str) -> torch.Tensor:
        t = self.env.get(name)
        if not isinstance(t, torch.Tensor):
            raise KBError(f"{name!r} is not a tile here (defined: {', '.join(sorted(self._tiles())) or 'none'})")
        return t

    def _tiles(self) -> list[str]:
        return [n for n, v in self.env.items() if isinstance(v, torch.Tensor)]

    def _param_tensor(self, name: str) -> tuple[Param, torch.Tensor]:
        try:
            return self.p.param(name), self.tensors[name]
        except KeyError:
            raise KBError(f"{name!r} is not a tensor param of program {self.p.name}") from None

    def _ixs(self, name: str, index: tuple[Index, ...]) -> tuple[torch.Tensor, TileIndex]:
        prm, t = self._param_tensor(name)
        ix = tile_index(t.shape, prm.shape, index, self.env, lambda e: self._int(e, "index"), self._lanes)
        return t, ix

    def _lanes(self, g: Gather) -> tuple[torch.Tensor, torch.Tensor]:
        """A gathered axis: each lane's tensor index and validity; invalid lanes' table loads are clamped."""
        size = resolve_dim(g.size, self.env)
        env = {**self.env, g.var: torch.arange(size)}
        ok = torch.ones(size, dtype=torch.bool) if g.valid is None else \
            torch.as_tensor(eval_expr(g.valid, env, self.aux)).bool().expand(size)
        tables = {n: ClampedAux(n, t, ok, "gathered index", "a valid lane") for n, t in self.aux.items()}
        pos = torch.as_tensor(eval_expr(g.index, env, tables))
        if pos.is_floating_point() or pos.dtype == torch.bool:
            raise KBError(f"gathered index {g.index} must be an integer, got {pos.dtype}")
        return pos.long().expand(size).clone(), ok.clone()

    def _coords(self, st: ScoreMod | Mask | ScoreModGrad | AuxGrad, tile: torch.Tensor) -> tuple[TileCoords, int, int]:
        if tile.dim() != 2:
            raise KBError(f"{st.tile} must be a 2-D score tile, has shape {list(tile.shape)}")
        at = st.at
        h = self._int(at.h, "h")
        heads = (h, resolve_dim(self.p.param("q").shape[1], self.env)) if at.head_rows else None
        coords = TileCoords(self._int(at.q_start, "q_start"), self._int(at.kv_start, "kv_start"),
                            tile.shape[0], tile.shape[1], self._bound("M"), self._bound("N"), heads)
        return coords, self._int(at.b, "b"), h

    # -- statements

    def s_let(self, st: Let) -> None:
        self.env[st.name] = self._eval(st.value)

    def s_load(self, st: Load) -> None:
        t, ix = self._ixs(st.tensor, st.index)
        self.env[st.out] = gather(t, ix, st.other)

    def s_store(self, st: Store) -> None:
        t, ix = self._ixs(st.tensor, st.index)
        write = scatter_add if st.accumulate else scatter
        self.c.elements_stored += write(t, ix, self._tile(st.value))

    def s_init(self, st: Init) -> None:
        shape = [resolve_dim(d, self.env) for d in st.shape]
        self.env[st.out] = torch.full(shape, self._fill(st), dtype=TORCH_DTYPES[st.dtype])

    def _fill(self, st: Init) -> float:
        """An init's fill; an expression (an attention sink, `sinks[h]`) evaluated to one number."""
        if not isinstance(st.fill, Expr):
            return st.fill
        v = torch.as_tensor(self._eval(st.fill))
        if v.numel() != 1 or v.dtype == torch.bool:
            raise KBError(f"init {st.out}: fill {st.fill} must be one number, got {v.dtype} of shape {list(v.shape)}")
        return float(v.reshape(()).item())

    def s_dot(self, st: Dot) -> None:
        a, b = self._tile(st.a).float(), self._tile(st.b).float()
        if a.dim() != 2 or b.dim() != 2:
            raise KBError(f"dot needs 2-D tiles, got {st.a} {list(a.shape)} and {st.b} {list(b.shape)}")
        a = a.transpose(0, 1) if st.trans_a else a
        b = b.transpose(0, 1) if st.trans_b else b
        if a.shape[1] != b.shape[0]:
            raise KBError(f"dot {'trans(' + st.a + ')' if st.trans_a else st.a} {list(a.shape)} @ "
                          f"{'trans(' + st.b + ')' if st.trans_b else st.b} {list(b.shape)}: inner dims differ")
        self.env[st.out] = a @ b

    def s_elementwise(self, st: Elementwise) -> None:
        v = self._eval(st.value)
        self.env[st.out] = v if isinstance(v, torch.Tensor) else torch.tensor(v)

    def s_reduce(self, st: Reduce) -> None:
        src = self._tile(st.src)
        if not -src.dim() <= st.axis < src.dim():
            raise KBError(f"reduce axis {st.axis} out of range for {st.src} of shape {list(src.shape)}")
        if st.kind == "max":
            self.env[st.out] = src.amax(dim=st.axis)
        elif st.kind == "sum":
            self.env[st.out] = src.sum(dim=st.axis)
        else:
            raise KBError(f"unknown reduction {st.kind!r}; use max or sum")

    def s_scoremod(self, st: ScoreMod) -> None:
        if self.p.score_mod is None:
            raise KBError(f"program {self.p.name} applies score_mod but defines none")
        tile = self._tile(st.tile)
        coords, b, h = self._coords(st, tile)
        self.env[st.tile] = eval_variant(self.p.score_mod, coords, self.variant_env, self.aux, b, h, score=tile)

    def s_mask(self, st: Mask) -> None:
        if st.use_mask_mod and self.p.mask_mod is None:
            raise KBError(f"program {self.p.name} masks with mask_mod but defines none")
        tile = self._tile(st.tile)
        coords, b, h = self._coords(st, tile)
        allowed = mask_tile(self.p.mask_mod if st.use_mask_mod else None, coords, self.variant_env,
                            self.aux, b, h, self.dims.get("N"))
        self.env[st.tile] = tile.masked_fill(~allowed, float("-inf"))
        self.c.masks_applied += 1

    def s_probs(self, st: Probs) -> None:
        self.env[st.out] = probs(self._tile(st.scores), self._tile(st.lse))

    def s_softmaxgrad(self, st: SoftmaxGrad) -> None:
        self.env[st.out] = softmax_grad(self._tile(st.p), self._tile(st.dp), self._tile(st.delta))

    def s_scoremodgrad(self, st: ScoreModGrad) -> None:
        if self.p.score_mod is None:
            return  # the identity's derivative
        s = self._tile(st.scores).float()
        coords, b, h = self._coords(st, s)
        g = eval_over_tile(score_grad(self.p.score_mod.body), coords, self.variant_env, self.aux, b, h, s)
        self.env[st.tile] = self._tile(st.tile) * g

    def s_auxgrad(self, st: AuxGrad) -> None:
        if self.p.score_mod is None:
            raise KBError(f"program {self.p.name} takes the gradient of {st.aux} but defines no score_mod")
        s, ds = self._tile(st.scores).float(), self._tile(st.tile).float()
        coords, b, h = self._coords(st, s)
        grad = self._param_tensor(st.grad)[1]
        body = self.p.score_mod.body
        env = dict(self.variant_env)
        if st.lse is not None:
            lse = self._tile(st.lse).float()
            env[ROW_LSE] = torch.where(lse.isinf(), 0.0, lse)[:, None]
        for index, partial in aux_partials(body, st.aux):
            centre = row_centre(body, index, partial) if st.lse is not None else None
            if centre is not None:
                partial = partial - centre
            value = ds * eval_over_tile(partial, coords, env, self.aux, b, h, s)
            where = coords.in_range
            pos = [eval_over_tile(i, coords, self.variant_env, self.aux, b, h, s).long()[where] for i in index]
            grad.index_put_(tuple(pos), value[where].to(grad.dtype), accumulate=True)

    def s_onlinesoftmax(self, st: OnlineSoftmax) -> None:
        m, l, acc = online_softmax_step(self._tile(st.m), self._tile(st.l), self._tile(st.acc),
                                        self._tile(st.scores), self._tile(st.values))
        self.env[st.m], self.env[st.l], self.env[st.acc] = m, l, acc

    def s_finalize(self, st: Finalize) -> None:
        self.env[st.o], self.env[st.lse] = finalize(self._tile(st.m), self._tile(st.l), self._tile(st.acc))

    def s_combine(self, st: Combine) -> None:
        self.env[st.o], self.env[st.lse] = combine(self._tile(st.o_parts), self._tile(st.lse_parts))

    def s_for(self, st: For) -> None:
        lo, hi = self._int(st.lo, f"{st.var} lower bound"), self._int(st.hi, f"{st.var} upper bound")
        step = resolve_dim(st.step, self.env)
        if step <= 0:
            raise KBError(f"loop {st.var} has step {step}; it must be positive")
        if st.order not in ("forward", "reverse"):
            raise KBError(f"loop {st.var} has order {st.order!r}; use forward or reverse")
        values = range(lo, hi, step)
        if st.step == "BLOCK_N":
            self.c.kv_loops += 1
            self.c.kv_blocks_visited += len(values)
            dense = math.ceil(self.dims["N"] / self.dims["BLOCK_N"]) if "N" in self.dims else len(values)
            self.c.kv_blocks_dense += dense
        for i in (reversed(values) if st.order == "reverse" else values):
            self.env[st.var] = i
            self._block(st.body)

    def s_ifblock(self, st: IfBlock) -> None:
        cls = classify_block(self.p.mask_mod, self.variant_env, self.aux,
                             self._int(st.at.b, "b"), self._int(st.at.h, "h"),
                             self._int(st.at.q_start, "q_start"), self._int(st.at.kv_start, "kv_start"),
                             self.dims["BLOCK_M"], self.dims["BLOCK_N"], self._bound("M"), self._bound("N"))
        self.c.classes[cls] += 1
        self._block(st.then if (cls is st.cls) != st.negate else st.orelse)
