"""A Triton kernel's tiles, names and addressing: the state below the statement emitters (kb.lower.triton_kernel).

`Signature` is the argument list every kernel of a program receives; `Tile` what the generator knows of a tile it
holds; `Region` the part of a split KV loop being generated. `TritonTiles` keeps the IR names visible at the current
line, the tiles, the `offs_*` aranges already made, and turns `tensor[index]` accesses into pointer/mask code
(also as tensor descriptors, hoisted before the outermost loop where they do not change in it).
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field

from kb.ir.algebra import next_pow2
from kb.ir.expr import Expr, ExprOp, free_vars, loaded_tensors, var, walk
from kb.ir.nodes import (
    BlockClass, Dtype, For, Gather, IfBlock, Kernel, Let, Load, Mask, Param, Program, Role, SCHEDULE_CONSTANTS, ScoreMod,
    Span, VALUE_DIM, is_backward, walk_stmts,
)
from kb.lower.block_mask import BlockMaskPlan
from kb.lower.expr_context import DTYPE_KIND, AuxRef, Kind, Sym, expr_kind, is_nonneg
from kb.lower.kernel_gen import KernelGenBase
from kb.lower.pack_gqa import PACK_ROWS, PackPlan, row_span
from kb.lower.serving import clamped_index, is_serving, kv_bound
from kb.lower.split_direct import SplitDirect
from kb.lower.triton_code import bcast, strip_parens, wrap
from kb.lower.triton_expr import lower_expr
from kb.lower.triton_options import LowerOptions


__all__ = ["Tile", "Signature", "LoopAxis", "AXES", "Region", "TritonTiles"]

_RESERVED = {"tl", "triton", "torch", "math", "os", "range", "float", "int", "max", "min", "pid", "dims", "grid"}


@dataclass(frozen=True)
class Tile:
    shape: tuple[str, ...]  # size codes (constexpr names or int literals), in the IR's orientation
    dtype: Dtype
    t: bool = False  # held transposed (a score tile [BLOCK_M, BLOCK_N] of a KV-major kernel, as [BLOCK_N, BLOCK_M])


@dataclass
class Signature:
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
    q_lists: bool = False  # qvl: the table's block lists per KV-block column (a backward's query loops run over them)
    o32: bool = False  # o32_ptr and O32: the store of o also writes an fp32 copy (the operator's O for the backward)
    q_split: bool = False  # SPLIT_Q constexpr: a KV-outer query loop split by block class when the design asks (q_split)
    gqa_group: tuple[str, str] | None = None  # (H, G): GQA_GROUP = H // G constexpr, a GQA group loop's trip count
    const_scalars: tuple[str, ...] = ()  # scalars passed as constexprs (kb.lower.serving.layout_scalars: a page size)
    direct: SplitDirect | None = None  # ONE_SPLIT constexpr: one split stores the outputs, no combine (split_direct)
    heavy_first: bool = False  # HEAVY_FIRST constexpr: a backward kernel's grid walked longest programs first (host)

    def runtime_scalars(self) -> list[str]:
        """The scalars the kernels take as arguments (the others are constexprs)."""
        return [s.name for s in self.scalars if s.name not in self.const_scalars]

    def args(self) -> list[str]:
        out = [f"{t.name}_ptr" for t in self.tensors]
        out += [f"stride_{t.name}_{i}" for t in self.tensors for i in range(len(t.shape))]
        out += list(self.dims) + self.runtime_scalars()
        if self.table:
            out += ["bc_ptr", "stride_bc_0", "stride_bc_1", "stride_bc_2", "stride_bc_3", "bc_nb", "bc_nh", "bc_nm", "bc_nn"]
            out += ["kvl_ptr", *(f"stride_kvl_{i}" for i in range(5))]
        if self.q_lists:
            out += ["qvl_ptr", *(f"stride_qvl_{i}" for i in range(5))]
        return out + (["o32_ptr"] if self.o32 else [])  # o's strides: o32 is allocated like o

    def constexprs(self) -> list[str]:
        return list(self.consts) + self.pads + (["EVEN_D"] if self.even_d else []) \
            + (["EVEN_DV"] if self.even_dv else []) + [f"POS_{n}" for n in self.pos_scalars] + (["USE_TMA"] if self.tma else []) + (["WARP_SPEC"] if self.ws else []) \
            + (["O32"] if self.o32 else []) + (["SPLIT_Q"] if self.q_split else []) \
            + (["GQA_GROUP"] if self.gqa_group is not None else []) + list(self.const_scalars) \
            + (["ONE_SPLIT"] if self.direct is not None else []) + (["HEAVY_FIRST"] if self.heavy_first else [])


@dataclass(frozen=True)
class LoopAxis:
    """What a loop over tiles steps along: a KV loop moves kv_start by BLOCK_N at a fixed q_start (block lists per
    query-block row, `kvl`); a KV-outer backward kernel's query loop moves q_start by BLOCK_M (lists per KV-block
    column, `qvl`)."""

    name: str
    step: str  # the loop's step (its own tile side)
    fixed_block: str  # the fixed tile's side
    moving: str  # TileAt field the loop variable is
    fixed: str  # TileAt field shared by the loop's tiles
    lists: str  # the host's block lists read by the loop
    count: str  # the lists' length (a bc_* dim)


AXES = {"kv": LoopAxis("kv", "BLOCK_N", "BLOCK_M", "kv_start", "q_start", "kvl", "bc_nn"),
        "q": LoopAxis("q", "BLOCK_M", "BLOCK_N", "q_start", "kv_start", "qvl", "bc_nm")}


@dataclass(frozen=True)
class Region:
    """One part of a split loop: the block classes its tiles at (b, h, q_start, var) can have. A KV loop's variable is
    the tile's kv_start; a backward KV-outer kernel's query loop (`axis` "q") steps q_start by BLOCK_M instead."""

    var: str  # the IR loop variable (the tile's kv_start, or q_start on the "q" axis)
    at: tuple[Expr, Expr, Expr]  # (b, h, the other start) shared by every mask / block test in the loop
    classes: frozenset[BlockClass]
    axis: str = "kv"
    # do the full blocks' moving tiles lie inside their dim? A KV tile does (the class table and the closed-form split
    # both ask it); a query tile from the table's lists may pass M, so its loads keep their row guard
    inside: bool = True
    # the tiles' moving start as the loop's tests write it where it is not the loop variable itself: `k0 + n_start`, a
    # packed sequence's first key plus the loop variable (kb.lower.triton_kernel's `moving_offset`)
    begin: Expr | None = None

    @property
    def full(self) -> bool:
        return self.classes == {BlockClass.FULL}

    @property
    def start(self) -> Expr:
        """The tiles' moving start as the loop's tests write it."""
        return var(self.var) if self.begin is None else self.begin

    def covers(self, st: Mask | IfBlock) -> bool:
        ax = AXES[self.axis]
        return getattr(st.at, ax.moving) == self.start and (st.at.b, st.at.h, getattr(st.at, ax.fixed)) == self.at

    def decide(self, st: IfBlock) -> bool | None:
        """Whether `block is st.cls` holds here (before negation); None when it varies per block."""
        if st.cls not in self.classes:
            return False
        return True if self.classes == {st.cls} else None


class TritonTiles(KernelGenBase[Tile]):
    """The generator's state and addressing; kb.lower.triton_kernel.TritonKernelGen adds the statement emitters."""

    INDENT = "    "

    def __init__(self, p: Program, k: Kernel, sig: Signature, plan: BlockMaskPlan, opts: LowerOptions,
                 pack: PackPlan | None = None) -> None:
        super().__init__(p, k, plan, sig.dims, sig.scalars)
        self.sig, self.opts = sig, opts
        self.pack = pack  # GQA packing: tile rows are (query head in group, query position) pairs
        self.backward = is_backward(p)  # backward programs: 16-bit tiles widened in elementwise math, dot operand casts
        # a varlen/paged layout (kb.lower.serving): `mask` bounds kv_idx by N only where the program has a dim N
        self.serving = is_serving(p)
        if self.serving and not (len(p.param("q").shape) == 4 and len(p.param("k").shape) == 4):
            self.m_dim, self.n_dim = "M", "N"  # not q's / k's third dim (a token-major q's is D)
        self.kv_bound: str | None = kv_bound(p) if self.serving else self.n_dim
        self.loaded: set[str] = set()  # tiles that hold a load's values (in the tensor's dtype at run time)
        # a backward kernel looping over q blocks (KV-outer: dk, dv of one KV block) holds its score tiles transposed,
        # kv rows by q columns, so P^T and dS^T enter the dV, dK dots as they are (no register transposes)
        self.kv_major = self.backward and pack is None and any(
            isinstance(x, For) and str(x.step) == "BLOCK_M" for x in walk_stmts(k.body))
        self.lets = {st.name: st.value for st in k.body if isinstance(st, Let)}  # top-level lets, for multiple_of
        self.table_reads: set[str] = set()  # scalars bound to a value read from a tensor (a page number)
        self.region: Region | None = None  # set while lowering one part of a split KV loop
        # while lowering a split loop's body once for all its parts: (the full part's region, the partial parts')
        self.parts: tuple[Region, Region] | None = None
        self.helpers: list[str] = []  # the `@triton.jit` helpers of split loops' bodies, lines at module level
        self.helper_names: dict[tuple, str] = {}  # (params, body, returns) -> helper name
        self.block_var: dict[str, str] = {}  # loop axis -> the loop variable's name in its helpers
        self.folded: dict[str, str] = {}  # score tile -> scalar param whose multiply was folded into exp2
        self.fold_next: dict[str, str] = {}
        self.offs: list[dict[tuple[str, str], str]] = [{}]
        self.used: set[str] = set()
        # where descriptors of loads inside the outermost loop are built: (line, depth, IR names set in the loop)
        self.hoist: tuple[int, int, set[str]] | None = None
        self.hoist_lines: list[str] = self.lines  # the kernel's lines, where hoisted code goes (a loop body's helper has its own)
        self.descs: dict[str, str] = {}  # descriptor construction code -> name, while hoisting
        self.deferred: dict[str, tuple[Load, int]] = {}  # split partials a combine reads one split at a time
        # a split kernel whose partials are the outputs at one split (ONE_SPLIT; kb.lower.split_direct)
        self.direct = sig.direct if sig.direct is not None and k.name != sig.direct.combine else None
        if pack is not None:  # a packed tile's rows run over G * M (query head in group, query position)
            self.m_dim = PACK_ROWS
            self.names[PACK_ROWS] = Sym("_pk_rows", Kind.INT, True)
        self.aux = {t.name: AuxRef(f"{t.name}_ptr", tuple(f"stride_{t.name}_{i}" for i in range(len(t.shape))),
                                   tuple(self._dim(d) for d in t.shape), DTYPE_KIND[t.dtype])
                    for t in sig.tensors if t.role is Role.AUX}

    # -- helpers
    def ex(self, e: Expr) -> str:
        return strip_parens(lower_expr(e, self.ctx()))

    def position(self, e: Expr) -> str:
        """A KV position (a loop bound): 32-bit, as tile offsets and descriptor loads need, also where it reads
        an int64 aux tensor (a per-batch prefix length)."""
        code = self.ex(e)
        return f"({code}).to(tl.int32)" if any(n.op is ExprOp.LOAD for n in walk(e)) else code

    def local(self, ir_name: str) -> str:
        code = ir_name if ir_name not in _RESERVED and not keyword.iskeyword(ir_name) and not ir_name.startswith("_") \
            and not ir_name.endswith("_ptr") and not ir_name.startswith(("stride_", "offs_", "bc_")) else f"v_{ir_name}"
        return code

    def reads_table(self, e: Expr) -> bool:
        """Does `e` depend on a value read from a tensor (a page number, a sequence's start)? Such an index times a
        row stride passes 2**31 elements in a serving engine's cache, so its address term is computed in int64."""
        return bool(loaded_tensors(e) or free_vars(e) & self.table_reads)

    def bind_scalar(self, name: str, e: Expr) -> str:
        if self.reads_table(e):
            self.table_reads.add(name)
        else:
            self.table_reads.discard(name)
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
        self.tiles[ir_name] = Tile(shape, dtype, t)
        self.loaded.discard(ir_name)
        self.names[ir_name] = Sym(code, DTYPE_KIND[dtype])
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

    # -- addressing
    def address(self, tensor: str, index: tuple) -> tuple[str, str | None, tuple[str, ...]]:
        """(pointer expression, mask expression or None, tile shape) of `tensor[index]`."""
        prm = self.tensor_param(tensor, index)
        spans: list[tuple[str, str, str, bool]] = []  # (offs, size, extent, needs lower guard)
        even: list[str] = []  # head-dim bounds, dropped when EVEN_D (EVEN_DV over the value head dim)
        even_flag = "EVEN_D"
        terms: list[str] = []
        lanes_ok: list[str] = []  # in-range tests beyond the dims' extents: a span's `until`, a gathered lane's
        scalar_ok: list[str] = []  # a serving program's tests of its scalar indices (a page number from a table)
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
                bc = offs + bcast(pos, rank)
                terms += [f"{head}{bcast(pos, rank)} * stride_{tensor}_{packed[0]}", f"{qpos}{bcast(pos, rank)} * {stride}"]
                spans.append((bc, str(item.size), "_pk_rows", False))
                pos += 1
                continue
            if isinstance(item, Expr):
                code = wrap(self.ex(item))
                if self.serving and self.reads_table(item):  # a page number: int64, as gathered rows are
                    code = f"{code}.to(tl.int64)"
                terms.append(f"{code} * {stride}")
                scalar_ok += self.scalar_bounds(item, d)
                continue
            if isinstance(item, Gather):
                rows, ok = self.gather_rows(item)
                bc = rows + bcast(pos, rank)
                terms.append(f"{bc} * {stride}")
                lanes_ok += [f"({ok}{bcast(pos, rank)})", f"({bc} >= 0)", f"({bc} < {self._dim(d)})"]
                pos += 1
                continue
            in_full_block = False
            if isinstance(item, Span):
                size = str(item.size)
                offs = self.offsets(item.start, size)
                guard = not is_nonneg(item.start, self.ctx())
                # a full block lies inside [0, N): n_start + BLOCK_N <= N (or [0, M) on a query loop's axis)
                in_full_block = self.region is not None and self.region.full and self.region.inside \
                    and item.start == self.region.start \
                    and (size, d) == (("BLOCK_N", self.n_dim) if self.region.axis == "kv" else ("BLOCK_M", self.m_dim))
                if item.until is not None:
                    lanes_ok.append(f"({offs}{bcast(pos, rank)} < {wrap(self.ex(item.until))})")
            else:
                size = self._full_size(d)
                offs = self.offsets(None, size)
                guard = False
            bc = offs + bcast(pos, rank)
            big = self.serving and isinstance(item, Span) and self.reads_table(item.start)  # packed tokens past 2**31
            terms.append(f"{bc}.to(tl.int64) * {stride}" if big else f"{bc} * {stride}")
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
        mask_parts += lanes_ok
        shape = tuple(str(item.size) if isinstance(item, (Span, Gather)) else self._full_size(d)
                      for d, item in zip(prm.shape, index) if not isinstance(item, Expr))
        ptr = f"{tensor}_ptr + " + " + ".join(terms)
        if scalar_ok:  # the tile's own tests (EVEN_D kept when nothing else makes the mask a tile) under the scalars'
            tile = " & ".join(mask_parts) if mask_parts or not even else None
            gated = lambda m: f"tl.where({' & '.join(scalar_ok)}, {m}, False)" if m else " & ".join(scalar_ok)  # noqa: E731
            both = gated(" & ".join(mask_parts + even))
            return ptr, f"({gated(tile)} if {even_flag} else {both})" if even and tile else both, shape
        if even:
            always = " & ".join(mask_parts)
            both = " & ".join(mask_parts + even)
            mask = f"({always or 'None'} if {even_flag} else {both})"
            return ptr, mask, shape
        return ptr, " & ".join(mask_parts) or None, shape

    def scalar_bounds(self, e: Expr, d: object) -> list[str]:
        """In-range tests of scalar index `e` along dim `d`, in a serving program only (a dense program's batch and
        head indices are in range by construction; a page number read from a table may not be, and the IR reads
        `other` there): `e >= 0` unless proven, `e < extent` unless `e` is a name known to stay below it. Scalar
        tests gate a tile mask through tl.where (the interpreter refuses a tile `&` a scalar)."""
        if not self.serving:
            return []
        code, extent = wrap(self.ex(e)), self._dim(d)
        out = [] if is_nonneg(e, self.ctx()) else [f"({code} >= 0)"]
        sym = self.names.get(str(e.value)) if e.op is ExprOp.VAR else None
        if not (sym is not None and sym.below == extent):
            out.append(f"({code} < {extent})")
        return out

    def gather_rows(self, g: Gather) -> tuple[str, str]:
        """(rows, ok): vectors over gathered axis `g`'s lanes: lane j's tensor index (`g.index` at `g.var` = j) and
        whether the lane is valid (`g.valid`). An invalid lane's table loads are clamped (kb.lower.serving
        `clamped_index`), so no table is read out of range. Made once per scope: the K and V loads of a token pool
        share one table lookup."""
        size = str(g.size)
        lanes = self.offsets(None, size)
        saved = {n: self.names[n] for n in (g.var, "_lane_ok") if n in self.names}
        self.names[g.var] = Sym(lanes, Kind.INT, True)
        try:
            valid = self.ex(g.valid) if g.valid is not None else "True"
            key = f"{self.ex(g.index)} if {valid}"
            for scope in reversed(self.offs):
                if (key, "__gather_rows__") in scope:
                    return scope[(key, "__gather_rows__")], scope[(key, "__gather_ok__")]
            ok, rows = self._fresh("_lane_ok"), self._fresh("_rows")
            # a lane-independent validity or index still makes one value per lane (a vector mask, a vector of rows)
            lane_free = g.valid is None or g.var not in free_vars(g.valid)
            valid = f"tl.where({strip_parens(valid)}, {lanes} >= 0, False)" if lane_free else wrap(valid)
            self.emit(f"{ok} = {valid}  # gathered lanes in use")
            self.names["_lane_ok"] = Sym(ok, Kind.BOOL)
            index = self.ex(clamped_index(g.index, "_lane_ok"))
            lane_free = g.var not in free_vars(g.index)
            # int64: a cache's rows times its row stride pass 2**31 elements (256 sequences x 32K tokens x 512)
            self.emit(f"{rows} = ({index}{f' + 0 * {lanes}' if lane_free else ''}).to(tl.int64)  # each lane's row "
                      f"(table loads clamped)")
        finally:
            for n in (g.var, "_lane_ok"):
                self.names.pop(n, None)
            self.names.update(saved)
        self.offs[-1][(key, "__gather_rows__")] = rows
        self.offs[-1][(key, "__gather_ok__")] = ok
        return rows, ok

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

    def tma_desc(self, tensor: str, index: tuple, store: bool = False) -> tuple[str, str] | None:
        """(descriptor name, offsets code) of a 2-D tile `tensor[e.., Span|Full, e.., Span|Full]` (the last dim a tile
        dim), or None.

        The descriptor covers the [rows, cols] slice at the scalar indices with the dims' true extents, so TMA's
        out-of-range zero fill / store clipping equal the masked form's bounds. A loaded span's `until` (a packed
        sequence's end) becomes its extent there, so lanes past it read 0 as masked; but at least 1 (a descriptor
        has no empty dim), so an empty sequence at row 0 reads that row into lanes whose results no store keeps.
        A store with an `until` keeps its masked form: it must write no row of an empty sequence.
        Packed rows (GQA packing) and gathered lanes are not a tile: no descriptor.
        """
        if not self.sig.tma or self.packed_dims(tensor, index) is not None or any(isinstance(i, Gather) for i in index) \
                or store and any(isinstance(i, Span) and i.until is not None for i in index):
            return None
        prm = self.p.param(tensor)
        n = len(prm.shape)
        tile = [i for i, item in enumerate(index) if not isinstance(item, Expr)]
        if n < 2 or prm.dtype not in (Dtype.BF16, Dtype.F16, Dtype.F32) or len(tile) != 2 or tile[1] != n - 1:
            return None
        sizes, starts, extents = [], [], []
        for i in tile:
            d, item = prm.shape[i], index[i]
            extent = self._dim(d)
            if isinstance(item, Span):
                if not is_nonneg(item.start, self.ctx()) and item.until is None:
                    return None  # (a packed sequence's start is a table value: TMA zero-fills a box below 0 too)
                size, start = str(item.size), self.ex(item.start)
                if item.until is not None:
                    extent = f"tl.maximum(tl.minimum({strip_parens(self.ex(item.until))}, {extent}), 1)"
            else:
                size, start = self._full_size(d), "0"
            if not (size in SCHEDULE_CONSTANTS or (size.isdigit() and 16 <= int(size) <= 256)):
                return None
            sizes.append(size)
            starts.append(start)
            extents.append(extent)
        lead = [(e, f"{wrap(self.ex(e))} * stride_{tensor}_{i}") for i, e in enumerate(index) if isinstance(e, Expr)]
        base = " + ".join([f"{tensor}_ptr"] + [t for _, t in lead])
        make = (f"tl.make_tensor_descriptor({base}, shape=[{', '.join(extents)}], "
                f"strides=[stride_{tensor}_{tile[0]}, 1], block_shape=[{', '.join(sizes)}]) if USE_TMA else None")
        if tensor not in self.sig.tma_tensors:
            self.sig.tma_tensors.append(tensor)
        if self.hoist is not None:
            line, depth, defined = self.hoist
            untils = [item.until for item in index if isinstance(item, Span) and item.until is not None]
            if any(free_vars(e) & defined for e in [e for e, _ in lead] + untils):
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
            self.hoist_lines.insert(line, "    " * depth + f"{name} = {code}")
            self.hoist = (line + 1, depth, defined)
            self.descs[code] = name
        return self.descs[code]

    def invariant_terms(self, e: Expr, st: ScoreMod | Mask, names: dict[str, Sym]) -> tuple[Expr, dict[str, Sym]]:
        """`e` with its loads that do not move along the KV loop (free of kv_idx and score, e.g. `doc[b, q_idx]`,
        `prefix[b]`) replaced by names loaded once before the outermost loop; `names` extended with them."""
        if self.hoist is None or any(free_vars(x) & self.hoist[2] for x in (st.at.b, st.at.h, st.at.q_start)):
            return e, names
        q_offs = names["h" if st.at.head_rows else "q_idx"].code.split("[")[0]  # the tile rows' offsets
        if not any(line.lstrip().startswith(f"{q_offs} = ") for line in self.hoist_lines[:self.hoist[0]]):
            return e, names  # the row offsets are made inside the loop: nothing to hoist them next to
        names = dict(names)
        ctx = self.ctx(names)

        def visit(x: Expr) -> Expr:
            if not x.args or not free_vars(x).isdisjoint({"kv_idx", "score"}):
                return Expr(x.op, tuple(visit(a) for a in x.args), x.value) if x.args else x
            if not any(n.op is ExprOp.LOAD for n in walk(x)):
                return x
            code = strip_parens(lower_expr(x, ctx))
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
        self.hoist, self.descs, self.hoist_lines = (len(self.lines), self.depth, defined), {}, self.lines
        return True

    def end_hoist(self, started: bool) -> None:
        if started:
            self.hoist, self.descs = None, {}

    def loop_range(self, st: For, lo: str, hi: str, step: str) -> str:
        """`range(...)`, or `tl.range(..., warp_specialize=WARP_SPEC)` for an innermost forward loop."""
        if self.sig.ws and not any(isinstance(x, For) for x in walk_stmts(st.body)):
            return f"tl.range({lo}, {hi}, {step}, warp_specialize=WARP_SPEC)"
        return f"range({lo}, {hi}, {step})"
