"""The Triton kernel generator: one `@triton.jit` function body per IR kernel, statement by statement.

Each IR statement becomes a few lines in the FlashAttention-2 Triton style (see kb.lower.triton); the tiles, names
and addressing it uses are `kb.lower.triton_tiles.TritonTiles`'. Beyond one statement at a time it spells the
fusions planned before it starts (kb.lower.triton_fusion: a dot accumulated into the tile it is added to, a
positive scale folded into the softmax exponent), streams split partials into a combine, and splits a KV loop by
block class (closed form or the host's block lists); a split loop's body is generated once, as a `@triton.jit`
helper (`helpers`) that each part calls with its `IS_FULL`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Iterable

from kb.errors import KBError
from kb.ir.algebra import max_of, simplify, tidy_int
from kb.ir.derive import ROW_LSE, aux_partials, row_centre, score_grad
from kb.ir.expr import Expr, ExprOp, call, const, free_vars, load, replace_subexprs, var, walk
from kb.ir.interval import bounds
from kb.ir.nodes import (
    DOT_MIN_K, AuxGrad, BlockClass, Combine, Dot, Dtype, Elementwise, Finalize, For, Full, GridAxis, IfBlock, Init, Let,
    Load, Mask, OnlineSoftmax, Param, Probs, Reduce, Role, SCHEDULE_CONSTANTS, ScoreMod, ScoreModGrad, SoftmaxGrad, Stmt, Store, walk_stmts,
)
from kb.ir.visit import StmtVisitor
from kb.lower.block_mask import (
    CLASS_CODE, PARTIAL, BlockMaskKind, block_class_test, full_span, kv_reach, transposed, union_span,
)
from kb.lower.expr_context import DTYPE_KIND, AuxRef, Kind, Sym, expr_kind, is_nonneg
from kb.lower.triton_code import LOG2E, NEG_INF, TL_DTYPE, bcast, float_code, load_other, strip_parens, wrap
from kb.lower.triton_expr import lower_expr
from kb.lower.triton_fusion import FusionPlan, plan_fusions, reads
from kb.lower.triton_outline import body_interface, merge_branches
from kb.lower.triton_tiles import AXES, Region, Tile, TritonTiles

__all__ = ["TritonKernelGen"]

# a learnable table's gradient tile whose index spans fewer values than this is summed per value before its atomics
# (T5's 32 buckets fit): each value costs one masked tile sum, against up to BLOCK_M * BLOCK_N contended atomics
_BINS = 32
# index operations that can map a tile's many positions to one value (so a tile-uniform test can hold)
_SATURATING = {ExprOp.MINIMUM, ExprOp.MAXIMUM, ExprOp.WHERE, ExprOp.TRUNC, ExprOp.FLOORDIV, ExprOp.SHR, ExprOp.CDIV}
_SPLIT_PARTIAL = frozenset({BlockClass.EMPTY, BlockClass.PARTIAL})  # closed-form split: partial parts may hold empty blocks


def _fma_dot(a: str, b: str, trans_b: bool) -> str:
    """`a @ b` (`a @ trans(b)`) as a broadcast multiply and a sum in fp32, for tiles with a side below DOT_MIN_K
    (TritonKernelGen.tiny: a literal side, or a serving schedule's block below 16).

    tl.dot wants every side >= 16 on GPUs (Triton pads M and N itself from 3.9, but not K, and not every version);
    padding a one-row decode tile to 16 rows would carry 15 dead rows through the softmax state. A single row times
    a [BLOCK_N, HEAD_PAD] tile is bandwidth-bound work the CUDA cores do at full speed (the paged-decode Triton
    kernels of serving engines compute it so), and it is exact in fp32 for 16-bit inputs."""
    if trans_b:  # a [M, K], b [N, K]
        return f"tl.sum({a}.to(tl.float32)[:, None, :] * {b}.to(tl.float32)[None, :, :], 2)"
    return f"tl.sum({a}.to(tl.float32)[:, :, None] * {b}.to(tl.float32)[None, :, :], 1)"


def moving_offset(begin: Expr, v: str) -> Expr | None:
    """`off` when a loop over `v` has its tiles start at `begin` = `off + v` (a packed sequence's first key `k0` plus
    n_start: the IR's positions are global token indices), else None."""
    if begin.op is not ExprOp.ADD or var(v) not in begin.args:
        return None
    return begin.args[1] if begin.args[0] == var(v) else begin.args[0]


class TritonKernelGen(TritonTiles, StmtVisitor[None]):
    """The body lines of one `@triton.jit` function (`generate`), statement by statement."""

    fusions: FusionPlan  # planned by `generate` before the first line

    # -- statements
    def block(self, body: tuple[Stmt, ...], emit: Callable[[], None] | None = None) -> None:
        """`body` (or what `emit` writes) in a scope of its own."""
        self.offs.append({})
        before = len(self.lines)
        if emit is None:
            self.statements(body)
        else:
            emit()
        if all(line.lstrip().startswith("#") for line in self.lines[before:]):
            self.emit("pass")
        self.offs.pop()

    def statements(self, body: tuple[Stmt, ...]) -> None:
        """`body` in the current scope, with the fusions planned for it (kb.lower.triton_fusion)."""
        fused: set[int] = set()
        for i, st in enumerate(body):
            if i in fused:
                continue
            c = self.fusions.fold(body, i)
            if c is not None:
                if c not in self.sig.pos_scalars:
                    self.sig.pos_scalars.append(c)
                self.fold_next[st.out] = c  # type: ignore[union-attr]
            acc = self.fusions.accumulator(body, i)
            if acc is not None:
                self.per_part(lambda: self.dot_into(st, acc))  # type: ignore[arg-type]
                fused.add(i + 1)
                continue
            if self.parts is not None and isinstance(st, IfBlock) and self.same_choice(st):
                continue
            self.per_part(lambda: self.visit(st))

    # -- a split loop's body, once for all its parts
    def _state(self) -> dict[str, object]:
        """A copy of what lowering a statement changes besides the lines (names, tiles, offsets made, ...)."""
        return {"names": dict(self.names), "tiles": dict(self.tiles), "offs": [dict(d) for d in self.offs],
                "used": set(self.used), "loaded": set(self.loaded), "folded": dict(self.folded),
                "fold_next": dict(self.fold_next), "table_reads": set(self.table_reads), "deferred": dict(self.deferred)}

    def _set_state(self, state: dict[str, object]) -> None:
        for attr, val in state.items():
            setattr(self, attr, copy.copy(val) if attr != "offs" else [dict(d) for d in val])  # type: ignore[attr-defined]

    def per_part(self, emit: Callable[[], None]) -> None:
        """`emit()`, or while lowering a split loop's body for all its parts (`parts`): `emit()` under each part's
        region, spelled once where the parts agree, else as `if IS_FULL:` (the full part's code) / `else:`, after the
        offsets both make first (made once, a later statement reuses them)."""
        if self.parts is None:
            emit()
            return
        full, partial = self.parts
        self.parts = None
        start = self._state()
        spelled = []
        for region in (full, partial):
            self._set_state(start)
            self.region, n = region, len(self.lines)
            emit()
            spelled.append(self.lines[n:])
            del self.lines[n:]
        if spelled[0] == spelled[1]:
            self.lines += spelled[1]  # the state is the partial part's, as it was left
        else:
            made = {name: key for key, name in self.offs[-1].items() if key not in start["offs"][-1]}  # type: ignore[index]
            self._set_state(start)
            for a, b in zip(*spelled):
                name = a.split(" = ", 1)[0].strip()
                if a != b or name not in made:
                    break
                self.lines.append(a)
                self.offs[-1][made[name]] = name
                self.used.add(name)
            shared = self._state()
            for header, region in (("if IS_FULL:", full), ("else:", partial)):
                self._set_state(shared)  # the state is the partial part's, as its branch left it
                self.emit(header)
                self.region = region
                self.depth += 1
                self.block((), emit)
                self.depth -= 1
        self.region, self.parts = None, (full, partial)

    def same_choice(self, st: IfBlock) -> bool:
        """While lowering for all parts: when every part's region runs the same branch of `st` without a test, emit
        that branch (still for all parts) and say so."""
        assert self.parts is not None
        full, partial = self.parts
        choices = []
        for region in (full, partial):
            self.region = region
            choices.append(self.decided(st))
        self.region = None
        full_choice, partial_choice = choices
        if full_choice is None or partial_choice is None or full_choice[1] != partial_choice[1]:
            return False
        self.emit(full_choice[0])
        self.emit(partial_choice[0])
        self.statements(full_choice[1])
        return True

    def split_dim(self, st: Load) -> int | None:
        """The NUM_SPLITS dim of a load of split partials that only a `combine` reads (as its o_parts), when it is
        the tile's first axis: the combine then streams them one split at a time instead of holding them all."""
        shape = self.p.param(st.tensor).shape
        tile_dims = [i for i, it in enumerate(st.index) if not isinstance(it, Expr)]
        if not tile_dims or shape[tile_dims[0]] != "NUM_SPLITS" or not isinstance(st.index[tile_dims[0]], Full):
            return None
        readers = [x for x in walk_stmts(self.k.body) if st.out in reads(x)]
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
        other = load_other(mask, float_code(st.other))
        plain = f"tl.load({ptr}" + (f", mask={mask}, other={other})" if mask else ")")
        self.emit(f"{out} = {desc[0]}.load([{desc[1]}]) if USE_TMA else {plain}" if desc else f"{out} = {plain}")
        self.loaded.add(st.out)

    def s_store(self, st: Store) -> None:
        if st.accumulate:
            self.accumulate_store(st)
            return
        direct = self.direct.direct_store(st) if self.direct is not None else None
        if direct is not None:
            self.emit(f"if ONE_SPLIT:  # one split: the partial is {direct.tensor} itself (the combine is not launched)")
            self.depth += 1
            self.block((), lambda: self.s_store(direct))  # each branch makes its own offsets
            self.depth -= 1
            self.emit("else:")
            self.depth += 1
            self.block((), lambda: self.plain_store(st))
            self.depth -= 1
            return
        self.plain_store(st)

    def plain_store(self, st: Store) -> None:
        ptr, mask, _ = self.address(st.tensor, st.index)
        value = f"{self.oriented(st.value, False)}.to({st.tensor}_ptr.dtype.element_ty)"
        plain = f"tl.store({ptr}, {value}" + (f", mask={mask})" if mask else ")")
        desc = self.tma_desc(st.tensor, st.index, store=True)
        if desc is None:
            self.emit(plain)
        else:
            self.emit("if USE_TMA:")
            self.emit(f"    {desc[0]}.store([{desc[1]}], {value})")
            self.emit("else:")
            self.emit(f"    {plain}")
        if st.tensor == "o" and self.sig.o32:
            copy = f"o32_ptr{ptr[len('o_ptr'):]}, {self.oriented(st.value, False)}.to(tl.float32)"
            self.emit("if O32:  # the fp32 copy of o the operator saves for the backward (same strides as o)")
            self.emit(f"    tl.store({copy}" + (f", mask={mask})" if mask else ")"))

    def s_init(self, st: Init) -> None:
        for d in st.shape:
            if isinstance(d, str) and d not in SCHEDULE_CONSTANTS:
                raise KBError(f"init {st.out}: tile dims must be schedule constants or ints, got {d!r}")
        shape = tuple(str(d) for d in st.shape)
        t = self.score_shaped(shape)
        out = self.set_tile(st.out, shape, st.dtype, t)
        if isinstance(st.fill, Expr):  # a scalar of the kernel (attention sinks: m starts at sinks[h])
            fill = self.ex(st.fill)
        else:
            fill = float_code(st.fill) if DTYPE_KIND[st.dtype] is Kind.FLOAT else repr(int(st.fill))
        self.emit(f"{out} = tl.full([{', '.join(shape[::-1] if t else shape)}], {fill}, {TL_DTYPE[st.dtype]})")

    def _prec(self, *tiles: Tile) -> str:
        return ', input_precision="ieee"' if all(t.dtype is Dtype.F32 for t in tiles) else ""

    def dot_shape(self, st: Dot) -> tuple[str, str]:
        """The (IR-oriented) shape of `st`'s result."""
        a, b = self.tile(st.a), self.tile(st.b)
        return (a.shape[-1] if st.trans_a else a.shape[0], b.shape[0] if st.trans_b else b.shape[-1])

    def s_dot(self, st: Dot) -> None:
        a, b = self.tile(st.a), self.tile(st.b)
        shape = self.dot_shape(st)
        t = self.score_shaped(shape)
        k_side = a.shape[0] if st.trans_a else a.shape[-1]
        if self.tiny(*shape, k_side) and not t and not self.backward:
            direct = st.trans_b and not st.trans_a and not a.t and not b.t  # q @ trans(k): no register transpose
            acode, bcode = (self.local(st.a), self.local(st.b)) if direct else self.dot_operands(st)
            out = self.set_tile(st.out, shape, Dtype.F32)
            self.emit(f"{out} = {_fma_dot(acode, bcode, direct)}  # a side below {DOT_MIN_K}: no tl.dot")
            return
        acode, bcode = self.dot_operands(st, t)
        out = self.set_tile(st.out, shape, Dtype.F32, t)
        self.emit(f"{out} = tl.dot({acode}, {bcode}{self._prec(a, b)})")

    def tiny(self, *sizes: str) -> bool:
        """Is one of these tile sides below DOT_MIN_K: a literal (a decode step's single query row, `h:+1`) or, in a
        serving module (which runs its own schedule), a BLOCK_M / BLOCK_N the schedule sets below 16 (a page of 8)?"""
        small = {"BLOCK_M": self.p.schedule.block_m, "BLOCK_N": self.p.schedule.block_n} if self.serving else {}
        return any(int(s) < DOT_MIN_K if s.isdigit() else small.get(s, DOT_MIN_K) < DOT_MIN_K for s in sizes)

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

    def dot_into(self, st: Dot, acc: str) -> None:
        if self.tile(acc).shape != self.dot_shape(st) or self.tile(acc).dtype is not Dtype.F32:
            raise KBError(f"dot {st.out}: accumulated into {acc}, which is not an fp32 tile of the dot's shape")
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
        code = self.ex(st.value) if not self.backward else strip_parens(lower_expr(st.value, self.ctx(self.widened(st.value, t))))
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
            if n in self.loaded and DTYPE_KIND[tile.dtype] is Kind.FLOAT:
                code = f"{code}.to(tl.float32)"
            if len(tile.shape) == 2 and tile.t != t:
                code = f"tl.trans({code})"
            names[n] = Sym(code, self.names[n].kind)
        return names

    def s_reduce(self, st: Reduce) -> None:
        src = self.tile(st.src)
        self.check_reduce(st)
        out = self.set_tile(st.out, tuple(s for i, s in enumerate(src.shape) if i != st.axis), src.dtype)
        self.emit(f"{out} = tl.{st.kind}({self.local(st.src)}, {1 - st.axis if src.t else st.axis})")

    def variant_names(self, st: ScoreMod | Mask | ScoreModGrad | AuxGrad, score: str | None) -> dict[str, Sym]:
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
        if st.at.head_rows:  # rows are the query heads h, h + 1, ... of one query position (a grouped decode tile)
            if tile.t:
                raise KBError(f"{st.op.value} {st.tile}: a transposed tile cannot have its rows as query heads")
            oh = self.offsets(st.at.h, tile.shape[0])
            names["h"] = Sym(f"{oh}[:, None]", Kind.INT, is_nonneg(st.at.h, self.ctx()))
            names["q_idx"] = Sym(wrap(self.ex(st.at.q_start)), Kind.INT, is_nonneg(st.at.q_start, self.ctx()))
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
        return Sym(wrap(self.ex(e)), Kind.INT, is_nonneg(e, self.ctx()))

    def s_scoremod(self, st: ScoreMod) -> None:
        score_mod = self.score_mod_body(st)
        code = self.local(st.tile)
        body, names = self.invariant_terms(score_mod, st, self.variant_names(st, code))
        uniform = self.uniform_loads(body, st, names)
        ctx = self.ctx(names)
        if uniform is None:
            self.emit(f"{code} = {strip_parens(lower_expr(body, ctx))}")
            return
        same, ends = uniform
        scalar = replace_subexprs(body, {x: load(str(x.value), *at) for x, at in ends.items()})
        self.emit(f"if {same}:  # each table index is one value over this tile: one read of the table")
        self.emit(f"    {code} = {strip_parens(lower_expr(scalar, ctx))}")
        self.emit("else:")
        self.emit(f"    {code} = {strip_parens(lower_expr(body, ctx))}")

    def uniform_loads(self, e: Expr, st: ScoreMod | AuxGrad, names: dict[str, Sym]
                      ) -> tuple[str, dict[Expr, tuple[Expr, ...]]] | None:
        """For the loads of `e` whose indices move over the tile (a relative-position table at bucket(kv_idx - q_idx)):
        emits each moving index's bounds over this tile (kb.ir.interval) as scalars `_ulo`/`_uhi` and gives the test
        that they meet, with each load's indices at those scalars. None where no load moves, a bound has no rule, or
        tile rows are not one query position each (GQA-packed or head rows). `names` gets the scalars."""
        moving = [x for x in dict.fromkeys(walk(e)) if x.op is ExprOp.LOAD
                  and any(free_vars(i) & {"q_idx", "kv_idx"} for i in x.args)]
        if self.pack is not None or st.at.head_rows \
                or not any(n.op in _SATURATING and free_vars(n) & {"q_idx", "kv_idx"}
                           for x in moving for i in x.args for n in walk(i)):
            # no load moves, or each moving index is one-to-one (rel[h, q_idx - kv_idx], qb[q_idx]; an offset read
            # from the table's size, rel[h, q_idx - kv_idx + (rel_n1 - 1) // 2], moves nothing)
            return None
        rows, cols = self.tile(st.tile).shape
        q0, k0 = self.ex(st.at.q_start), self.ex(st.at.kv_start)
        corners = {"_tq0": q0, "_tq1": f"{wrap(q0)} + {rows} - 1", "_tk0": k0, "_tk1": f"{wrap(k0)} + {cols} - 1"}
        box = {"q_idx": (var("_tq0"), var("_tq1")), "kv_idx": (var("_tk0"), var("_tk1"))}
        found = {x: [bounds(i, box) for i in x.args] for x in moving}
        if any(r is None for rs in found.values() for r in rs):
            return None
        ctx = self.ctx({**names, **{n: Sym(wrap(c), Kind.INT) for n, c in corners.items()}})
        tests: list[str] = []
        ends: dict[Expr, tuple[Expr, ...]] = {}
        for x, ranges in found.items():
            at: list[Expr] = []
            for i, r in zip(x.args, ranges):
                assert r is not None
                if not free_vars(i) & {"q_idx", "kv_idx"}:
                    at.append(i)
                    continue
                lo = self._tile_bound(strip_parens(lower_expr(simplify(r[0]), ctx)), "_ulo")
                hi = self._tile_bound(strip_parens(lower_expr(simplify(r[1]), ctx)), "_uhi")
                names[lo] = Sym(lo, expr_kind(i, ctx))
                tests.append(f"({lo} == {hi})")
                at.append(var(lo))
            ends[x] = tuple(at)
        return " & ".join(tests), ends

    def _tile_bound(self, code: str, base: str) -> str:
        """A scalar named for `code`, emitted once per scope as offsets are (a table gradient's test reuses the bounds
        its score_mod computed over the same tile)."""
        key = (code, "__tile_bound__")
        for scope in reversed(self.offs):
            if key in scope:
                return scope[key]
        name = self._fresh(base)
        self.emit(f"{name} = {code}")
        self.offs[-1][key] = name
        return name

    def s_mask(self, st: Mask) -> None:
        code = self.local(st.tile)
        if self.region is not None and self.region.full and self.region.covers(st) \
                and self.tile(st.tile).shape == ("BLOCK_M", "BLOCK_N"):
            self.emit(f"# full block: every in-range pair attends and no kv index is past N; no mask for {code}")
            return
        names = self.variant_names(st, None)
        # kv_idx < N where the program has a dim N (a token-major or paged one has none: its mask_mod bounds it)
        keep = [f"({names['kv_idx'].code} < {self.kv_bound})"] if self.kv_bound is not None else []
        if st.use_mask_mod:
            body, names = self.invariant_terms(self.mask_mod_body(st), st, names)
            keep.append(wrap(lower_expr(body, self.ctx(names))))
        if not keep:
            self.emit(f"# mask {code} bounds: the program has no dim N, so nothing is masked here")
            return
        self.emit(f"{code} = tl.where({' & '.join(keep)}, {code}, {NEG_INF})")

    # -- backward statements
    def s_probs(self, st: Probs) -> None:
        s_t, l_t = self.tile(st.scores), self.tile(st.lse)
        if len(s_t.shape) != 2 or len(l_t.shape) != 1:
            raise KBError(f"probs {st.out}: needs a 2-D score tile and a row vector, got {s_t.shape} and {l_t.shape}")
        s, lse = self.local(st.scores), self.local(st.lse)
        lse_bc = self.rows(st.scores, "_lse_log2")
        out = self.set_tile(st.out, s_t.shape, Dtype.F32, s_t.t)
        self.emit(f"# p = exp({s} - {lse}); a row with lse = -inf (nothing attends) and a row past M (lse read as +inf) get 0")
        self.emit(f'_lse_log2 = tl.where({lse} == {NEG_INF}, float("inf"), {lse}) * {LOG2E}')
        self.emit(f"{out} = tl.exp2({s} * {LOG2E} - {lse_bc})")

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
        code = self.local(st.tile)
        grad = score_grad(self.p.score_mod.body) if self.p.score_mod is not None else const(1)
        if grad.op is ExprOp.CONST and grad.value == 1:
            self.emit(f"# score_mod_grad {code}: d score_mod / d score is 1 here")
            return
        names = self.variant_names(st, self.oriented(st.scores, self.tile(st.tile).t))
        self.emit(f"{code} = {code} * {wrap(strip_parens(lower_expr(grad, self.ctx(names))))}  # d score_mod / d score")

    def s_auxgrad(self, st: AuxGrad) -> None:
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
        body = self.p.score_mod.body
        partials = [(index, partial, row_centre(body, index, partial) if st.lse is not None else None)
                    for index, partial in aux_partials(body, st.aux)]
        if any(c is not None for *_, c in partials):
            lse = self.local(st.lse)  # type: ignore[arg-type]
            self.emit("# the row centre's lse: 0 where it is infinite (an empty row, a row past M: ds is 0 there)")
            self.emit(f"_lse_row = tl.where(tl.abs({lse}) == float('inf'), 0.0, {lse})")
            names[ROW_LSE] = Sym(self.rows(st.tile, "_lse_row"), Kind.FLOAT)
        for index, partial, centre in partials:
            if len(index) != len(grad.shape):
                raise KBError(f"aux_grad {st.grad}: {st.aux} is indexed with {len(index)} indices, {st.grad} has {len(grad.shape)} dims")
            if centre is not None:
                partial = partial - centre
            read = load(st.aux, *index)
            uniform = self.uniform_loads(read, st, names)
            self.aux_scatter(st.grad, grad, index, f"{ds} * {wrap(strip_parens(lower_expr(partial, self.ctx(names))))}",
                             in_range, names, self.tile(st.tile).t,
                             None if uniform is None else (uniform[0], uniform[1][read]))

    def aux_scatter(self, name: str, grad: Param, index: tuple[Expr, ...], value: str, in_range: str,
                    names: dict[str, Sym], t: bool = False,
                    uniform: tuple[str, tuple[Expr, ...]] | None = None) -> None:
        """grad[index] += value over the in-range tile, summed first over the tile axes the index does not move along;
        `uniform` (the test that the index is one value over the tile, and that value) adds the tile's whole sum at
        once where the test holds."""
        ctx = self.ctx(names)
        terms: list[str] = []
        guards: dict[bool, list[str]] = {True: [], False: []}  # bounds of tile-shaped / scalar indices
        for i, (e, d) in enumerate(zip(index, grad.shape)):
            code = wrap(strip_parens(lower_expr(e, ctx)))
            terms.append(f"{code} * stride_{name}_{i}")
            tiled = bool(free_vars(e) & {"q_idx", "kv_idx"})
            if not is_nonneg(e, ctx):
                guards[tiled].append(f"({code} >= 0)")
            if not (e.op is ExprOp.VAR and names.get(str(e.value), Sym("", Kind.INT)).below == self._dim(d)):
                guards[tiled].append(f"({code} < {self._dim(d)})")
        moves = set().union(*(free_vars(e) for e in index)) & {"q_idx", "kv_idx"}
        tile_axes = [i for i, e in enumerate(index) if free_vars(e) & {"q_idx", "kv_idx"}]
        if moves == {"q_idx", "kv_idx"} and uniform is not None:
            self.emit(f"if {uniform[0]}:  # the index is one value over this tile: one sum, one atomic")
            self.depth += 1
            self.aux_scatter(name, grad, uniform[1], value, in_range, names, t)
            self.depth -= 1
            self.emit("else:")
            self.depth += 1
            self.aux_scatter(name, grad, index, value, in_range, names, t)
            self.depth -= 1
            return
        if moves == {"q_idx", "kv_idx"} and len(tile_axes) == 1:
            axis = tile_axes[0]
            self._binned_scatter(name, terms, axis, wrap(strip_parens(lower_expr(index[axis], ctx))), value,
                                 [in_range, *guards[True]], guards[False])
            return
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

    def _binned_scatter(self, name: str, terms: list[str], axis: int, index: str, value: str, tile_guards: list[str],
                        scalar_guards: list[str]) -> None:
        """grad[.., index, ..] += value where the index moves along both tile axes (a relative-position table,
        T5 buckets of j - i): one atomic per element puts every product of the whole sequence on the few table
        entries, serialised there; so a tile whose in-range indices span fewer than _BINS values sums each value's
        elements in registers first (one masked tile sum and one atomic per value), and only a wider span (a table
        with an entry per distance: up to BLOCK_M + BLOCK_N - 1 values) adds element by element."""
        ok = " & ".join(tile_guards)
        binned = [*terms]
        binned[axis] = f"_bin * stride_{name}_{axis}"
        pad = ""
        if scalar_guards:
            self.emit(f"if {' & '.join(scalar_guards)}:")
            pad = "    "
        self.emit(f"{pad}_ix = {index}")
        self.emit(f"{pad}_ok = {ok}")
        self.emit(f"{pad}_gv = tl.where(_ok, {value}, 0.0)")
        self.emit(f"{pad}_lo = tl.min(tl.min(tl.where(_ok, _ix, 2147483647), 1), 0)")
        self.emit(f"{pad}_hi = tl.max(tl.max(tl.where(_ok, _ix, -1), 1), 0)")
        self.emit(f"{pad}if _hi - _lo < {_BINS}:  # the tile's values of the index, summed per value first")
        self.emit(f"{pad}    for _bin in range(_lo, _hi + 1):")
        self.emit(f"{pad}        tl.atomic_add({name}_ptr + {' + '.join(binned)}, "
                  f"tl.sum(tl.sum(tl.where(_ix == _bin, _gv, 0.0), 1), 0), sem=\"relaxed\")  # d {name}")
        self.emit(f"{pad}else:")
        self.emit(f"{pad}    tl.atomic_add({name}_ptr + {' + '.join(terms)}, _gv, mask=_ok, sem=\"relaxed\")  # d {name}")

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
            self.emit(f"_qk_scale = {cc} * {LOG2E} if POS_{c} else {LOG2E}")
        self.emit("# rows with no unmasked score yet keep m = -inf; use 0 there so exp2 sees -inf, never NaN")
        self.emit(f"_m_log2 = tl.where(_m_new == {NEG_INF}, 0.0, _m_new) * {LOG2E}")
        self.emit(f"_alpha = tl.exp2({m} * {LOG2E} - _m_log2)")
        self.emit(f"_p = tl.exp2({s} * {LOG2E if c is None else '_qk_scale'} - _m_log2[:, None])")
        self.emit(f"{l} = {l} * _alpha + tl.sum(_p, 1)")
        if self.tiny(*self.tile(st.scores).shape, *self.tile(st.values).shape):
            self.emit(f"{acc} = {acc} * _alpha[:, None] + {_fma_dot('_p', v, False)}  # a side below {DOT_MIN_K}: no tl.dot")
        elif self._split_p(self.tile(st.values)):
            self.emit(f"# fp32 output from 16-bit V: P enters as a hi/lo pair of {v}.dtype tiles, so P keeps ~16 bits")
            self.emit(f"_p_hi = _p.to({v}.dtype)")
            self.emit(f"{acc} = tl.dot(_p_hi, {v}, {acc} * _alpha[:, None])")
            self.emit(f"{acc} = tl.dot((_p - _p_hi.to(tl.float32)).to({v}.dtype), {v}, {acc})")
        else:
            self.emit(f"{acc} = tl.dot(_p.to({v}.dtype), {v}, {acc} * _alpha[:, None]{prec})")
        self.emit(f"{m} = _m_new")

    def _split_p(self, v: Tile) -> bool:
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
        self.emit(f"{lse} = tl.where({l} == 0.0, {NEG_INF}, {m} + tl.log(_l_safe))")

    def s_combine(self, st: Combine) -> None:
        po_t, pl_t = self.tile(st.o_parts), self.tile(st.lse_parts)
        if len(po_t.shape) != len(pl_t.shape) + 1:
            raise KBError(f"combine {st.o}: o_parts must have one more dim than lse_parts")
        po, pl = self.local(st.o_parts), self.local(st.lse_parts)
        o = self.set_tile(st.o, po_t.shape[1:], Dtype.F32)
        lse = self.set_tile(st.lse, pl_t.shape[1:], Dtype.F32)
        w_bc = "[" + ", ".join([":"] * len(pl_t.shape) + ["None"]) + "]"
        self.emit(f"_lse_max = tl.max({pl}, 0)")
        self.emit(f"_lse_max = tl.where(_lse_max == {NEG_INF}, 0.0, _lse_max)")
        self.emit(f"_w = tl.exp({pl} - _lse_max[None, :])  # splits without keys have lse = -inf: weight 0")
        self.emit("_w_sum = tl.sum(_w, 0)")
        self.emit("_w_safe = tl.where(_w_sum == 0.0, 1.0, _w_sum)")
        self.emit(f"{lse} = tl.where(_w_sum == 0.0, {NEG_INF}, _lse_max + tl.log(_w_safe))")
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
        self.emit(f"_w_sp = tl.sum(tl.where(tl.arange(0, {pl_t.shape[0]}){bcast(0, len(pl_t.shape))} == _sp, _w, 0.0), 0)")
        other = load_other(mask, "0.0")
        self.emit(f"{o} += _w_sp{one} * tl.load({ptr}" + (f", mask={mask}, other={other})" if mask else ")"))
        self.offs.pop()
        self.depth -= 1
        self.emit(f"{o} = {o} / _w_safe[:, None]")

    def split_at(self, st: For) -> tuple[Expr, Expr, Expr] | None:
        """(b, h, the other start) of the loop's tile when the loop can be split by block class in closed form: a KV
        loop, or the query loop of a KV-outer backward kernel (which s_for emits both ways, for Design.q_split)."""
        plan = self.plan
        if not self.opts.split_kv_loop or plan.kind is BlockMaskKind.TABLE \
                or any(d.beta == 0 and d.alpha == 0 for c in plan.disjuncts for d in c) \
                or (self.pack is not None and plan.kind is not BlockMaskKind.NO_MASK):
            return None
        axis = self.loop_axis(st)
        return self.loop_tile(st, ("forward", "reverse"), axis, offset=axis == "kv")

    def loop_axis(self, st: For) -> str:
        """"q" for a KV-major kernel's loop over query tiles (step BLOCK_M), else "kv"."""
        return "q" if self.kv_major and str(st.step) == "BLOCK_M" else "kv"

    def indexed_at(self, st: For) -> tuple[Expr, Expr, Expr] | None:
        """(b, h, the other start) of the loop's tile when the loop can run over the host's block lists: a KV loop
        over a query-block row's lists, or a KV-outer backward kernel's query loop over a KV-block column's."""
        if not self.opts.indexed_kv_loop or not self.sig.table or self.pack is not None:
            return None
        # the lists visit partial, then full blocks, ascending, whatever the IR's order (the order only moves
        # rounding): a reverse loop over a table would otherwise branch on every block up to its bound
        ax = AXES[self.loop_axis(st)]
        at = self.loop_tile(st, ("forward", "reverse"), ax.name)
        if at is None or not self.multiple_of(at[2], ax.fixed_block) or not self.multiple_of(st.lo, ax.step):
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

    def loop_tile(self, st: For, orders: tuple[str, ...] = ("forward",), axis: str = "kv",
                  offset: bool = False) -> tuple[Expr, Expr, Expr] | None:
        """(b, h, q_start) when every mask / block test in a BLOCK_N loop (in one of `orders`) concerns the loop's own
        tile; on the "q" axis, (b, h, kv_start) of a BLOCK_M loop over query tiles. With `offset`, the tiles' moving
        start may be the loop variable plus a term the loop does not change (`moving_offset`)."""
        ax = AXES[axis]
        if self.region is not None or st.order not in orders or str(st.step) != ax.step:
            return None
        stmts = list(walk_stmts(st.body))
        tests = [x for x in stmts if isinstance(x, (Mask, IfBlock))]
        if not tests or any(isinstance(x, For) for x in stmts):
            return None
        at = (tests[0].at.b, tests[0].at.h, getattr(tests[0].at, ax.fixed))
        begin = self.tile_begin(st, axis)
        defined = {st.var} | {getattr(x, n) for x in stmts for n in ("out", "name", "o", "lse", "m", "l", "acc")
                              if isinstance(getattr(x, n, None), str)}
        off = moving_offset(begin, st.var) if offset else None
        if begin != var(st.var) and (off is None or free_vars(off) & defined):
            return None
        if any(getattr(x.at, ax.moving) != begin or (x.at.b, x.at.h, getattr(x.at, ax.fixed)) != at for x in tests):
            return None
        if any(free_vars(e) & defined for e in at):
            return None
        return at

    def tile_begin(self, st: For, axis: str) -> Expr:
        """The moving start of the tiles loop `st`'s first mask / block test is at."""
        first = next(x for x in walk_stmts(st.body) if isinstance(x, (Mask, IfBlock)))
        return getattr(first.at, AXES[axis].moving)

    def s_for(self, st: For) -> None:
        at = self.split_at(st)
        if at is not None and self.loop_axis(st) == "q":
            # a KV-outer query loop: both forms, the design picks (Design.q_split). Split, its full part runs without
            # a branch and Triton pipelines its q/dO loads: 8-11% faster at the right stages in a hand-written copy
            # of the causal D=128 kernel (run 19), up to 2x slower at the wrong ones (run 17); generated, it won ALiBi
            # and lost to windows. Under the per-step branch the loop is not pipelined. Sweeps decide.
            self.sig.q_split = True
            split_at = at  # narrowed: the lambda below keeps the type
            self.emit_branch("if SPLIT_Q:  # the design's q_split: partial / full / partial query blocks",
                             lambda: self.split_for(st, split_at), "else:  # every query block under its block-class branch",
                             lambda: self.plain_for(st))
            return
        if at is not None:
            self.split_for(st, at)
            return
        at = self.indexed_at(st)
        if at is not None:
            self.indexed_for(st, at)
            return
        self.plain_for(st)

    def plain_for(self, st: For) -> None:
        lo, hi, step = self.ex(st.lo), self.ex(st.hi), str(st.step)
        group = self.head_group(st)
        if group is not None:
            # a constant trip count: with one query head per KV head the loop folds away (run 19, H100: the runtime
            # bound cost the causal D=128 backward 0.6 of 8.4 ms)
            g = self.ex(var(group[0]))
            lo, hi = f"{g} * GQA_GROUP", f"{g} * GQA_GROUP + GQA_GROUP"
            self.sig.gqa_group = group[1:]
        loop_var = self.local(st.var)
        self._invalidate(loop_var)
        sym = self.loop_sym(st, loop_var, self.loop_below(st))
        self.check_order(st)
        started = self.start_hoist(st)
        if st.order == "reverse":
            n_iter = f"_n_iter_{loop_var}"
            self.emit(f"{n_iter} = tl.cdiv({hi} - {wrap(lo)}, {step})")
            self.emit(f"for _it_{loop_var} in range(0, {n_iter}):")
            self.depth += 1
            self.emit(f"{loop_var} = {wrap(lo)} + ({n_iter} - 1 - _it_{loop_var}) * {step}")
            self.depth -= 1
        else:
            self.emit(f"for {loop_var} in {self.loop_range(st, lo, hi, step)}:")
        self.names[st.var] = sym
        self.depth += 1
        self.block(st.body)
        self.depth -= 1
        self.end_hoist(started)

    def head_group(self, st: For) -> tuple[str, str, str] | None:
        """(g, H, G) for a loop over a GQA group's query heads, `range(g * (H // G), (g + 1) * (H // G), 1)` with g a
        variable and H, G dims, else None."""
        lo, hi = st.lo, st.hi
        if str(st.step) != "1" or lo.op is not ExprOp.MUL or hi.op is not ExprOp.MUL:
            return None
        (g, ratio), (g1, ratio1) = lo.args, hi.args
        if ratio != ratio1 or ratio.op is not ExprOp.FLOORDIV or g.op is not ExprOp.VAR \
                or g1.op is not ExprOp.ADD or g1.args != (g, const(1)) \
                or any(a.op is not ExprOp.VAR or str(a.value) not in self.sig.dims for a in ratio.args):
            return None
        big, small = (str(a.value) for a in ratio.args)
        return str(g.value), big, small

    def loop_below(self, st: For) -> str | None:
        """The dim a loop variable stays below, when the bound says so: `hi` a dim, or a GQA group's head range
        with g a grid axis below G (aux loads indexed by it then need no guard)."""
        hi = st.hi
        if hi.op is ExprOp.VAR and str(hi.value) in self.sig.dims:
            return str(hi.value)
        group = self.head_group(st) if self.backward else None
        if group is None:
            return None
        g, big, small = group
        sym = self.names.get(g)
        return big if sym is not None and sym.below == small else None

    def split_for(self, st: For, at: tuple[Expr, Expr, Expr]) -> None:
        """Three loops over [lo, hi): partial blocks, then full blocks, then partial blocks (ascending order). On the
        "q" axis the same over query tiles at a fixed KV tile: the bounds transposed, and no block of a KV tile
        past N is full."""
        v = self.local(st.var)
        axis = self.loop_axis(st)
        own, block, fixed_dim, fixed_block = ((self.n_dim, "BLOCK_N", self.m_dim, "BLOCK_M") if axis == "kv"
                                              else (self.m_dim, "BLOCK_M", self.n_dim, "BLOCK_N"))
        f0 = at[2]
        f1 = call("minimum", f0 + var(fixed_block), var(fixed_dim)) - 1
        sub = {"b": at[0], "h": at[1]}
        # spans are of the tiles' moving start; a loop whose tiles start at off + var (moving_offset) runs them less off
        begin = self.tile_begin(st, axis)
        off = moving_offset(begin, st.var)
        lo_at = st.lo if off is None else st.lo + off
        bounds = self.plan.disjuncts if axis == "kv" else tuple(transposed(d) for d in self.plan.disjuncts)
        spans = [full_span(d, (f0, f1), lo_at, var(own), sub, block) for d in bounds] \
            or [(lo_at, var(own) - var(block))]
        first, last = spans[0]
        for f, l in spans[1:]:
            first, last = union_span((first, last), (f, l))
        if axis == "q":
            first = call("where", f0 + var("BLOCK_N") <= var(self.n_dim), first, var(own))
        hi_expr = st.hi
        if len(bounds) > 1:  # a union: past the last position any disjunct can reach, every block is empty
            reach = max_of([kv_reach(d, (f0, f1), var(own), sub) for d in bounds])
            hi_expr = call("minimum", hi_expr, reach if off is None else reach - off)
        if off is not None:
            first, last = first - off, last - off
        what_loop = "KV loop" if axis == "kv" else "query loop (KV-outer)"
        self.emit(f"# {what_loop} split by block class: partial blocks, full blocks (no mask code), partial blocks")
        lo, hi = f"_kv_lo_{v}", f"_kv_hi_{v}"
        self.emit(f"{lo} = {self.position(st.lo)}")
        self.emit(f"{hi} = {self.position(tidy_int(hi_expr))}")
        self.emit(f"_n_iter_{v} = tl.cdiv(tl.maximum({hi} - {lo}, 0), {block})")
        self.emit(f"_full_first_{v} = {self.position(tidy_int(first))}")
        self.emit(f"_full_last_{v} = {self.position(tidy_int(last))}")
        self.emit(f"_i_a_{v} = tl.minimum(tl.cdiv(tl.maximum(_full_first_{v} - {lo}, 0), {block}), _n_iter_{v})")
        self.emit(f"_i_b_{v} = tl.minimum(tl.maximum(tl.where(_full_last_{v} >= {lo}, "
                  f"(_full_last_{v} - {lo}) // {block} + 1, 0), _i_a_{v}), _n_iter_{v})")
        parts = [("0", f"_i_a_{v}", False), (f"_i_a_{v}", f"_i_b_{v}", True), (f"_i_b_{v}", f"_n_iter_{v}", False)]
        if st.order == "reverse":  # the same parts, last first, each descending: the IR's order exactly
            parts.reverse()
        started = self.start_hoist(st)
        tiles_at = None if off is None else begin
        call_part = self.outline(st, self.loop_sym(st, v), Region(st.var, at, frozenset({BlockClass.FULL}), axis, begin=tiles_at),
                                 Region(st.var, at, _SPLIT_PARTIAL, axis, begin=tiles_at))
        for i_lo, i_hi, full in parts:
            what = "full" if full else "partial"
            if st.order == "reverse":
                it = f"_it_{v}"
                self.emit(f"for {it} in range(0, {i_hi} - {i_lo}):  # {what} blocks, descending")
                self.emit(f"    {v} = {lo} + ({i_hi} - 1 - {it}) * {block}")
            else:
                a = lo if i_lo == "0" else f"{lo} + {i_lo} * {block}"
                b = hi if i_hi == f"_n_iter_{v}" else f"{lo} + {i_hi} * {block}"
                self.emit(f"for {v} in {self.loop_range(st, a, b, block)}:  # {what} blocks")
            self.emit(f"    {call_part(full)}")
        self.end_hoist(started)

    def outline(self, st: For, sym: Sym, full: Region, partial: Region) -> Callable[[bool], str]:
        """Lower the body of split loop `st` once, as a `@triton.jit` helper (`helpers`) whose IS_FULL constexpr picks
        the full part's code where it differs from the partial parts'; the call a part's loop makes, given IS_FULL.
        The helper names the loop variable as the kernel's first split loop on this axis did, so loops with the same
        body (the two KV loops of a lifted AMD kernel) share one helper."""
        own = self.block_var.setdefault(full.axis, sym.code)
        kernel_lines, depth, used = self.lines, self.depth, set(self.used)
        self.lines, self.depth = [], 1
        self._invalidate(sym.code)
        self._invalidate(own)
        self.names[st.var] = dataclasses.replace(sym, code=own)
        self.parts = (full, partial)
        self.block(st.body)
        self.parts = None
        body, self.lines, self.depth = merge_branches(self.lines), kernel_lines, depth
        self.used = used | set(self.descs.values())
        self.names[st.var] = sym
        iface = body_interface(body)
        args, consts = self.sig.args(), self.sig.constexprs()
        rest = [n for n in iface.params if n not in (own, "IS_FULL")]
        # the loop variable, the kernel's locals, the carried state, then the kernel's arguments and constexprs in its order
        params = [own, *(n for n in rest if n not in args and n not in consts and n not in iface.returns),
                  *(n for n in rest if n in iface.returns), *(n for n in args if n in rest), *(n for n in consts if n in rest)]
        returns = [n for n in params if n in iface.returns]
        key = (tuple(params), tuple(body), tuple(returns))
        name = self.helper_names.get(key)
        if name is None:
            base = f"_{self.k.name}{'_packed' if self.pack is not None else ''}_{full.axis}_block"
            name = base + (str(len(self.helper_names) + 1) if self.helper_names else "")
            self.helper_names[key] = name
            what = "KV block" if full.axis == "kv" else "query block"
            self.helpers += ["", "@triton.jit", f"def {name}(",
                             *(f"    {n}: tl.constexpr," if n in consts else f"    {n}," for n in params),
                             *(["    IS_FULL: tl.constexpr,"] if "IS_FULL" in iface.params else []), "):",
                             f"    # one {what} of a loop split by block class; IS_FULL: a full block (no mask code)", *body]
            if returns:
                self.helpers.append(f"    return {', '.join(returns)}")
        call_args = ", ".join([sym.code, *params[1:]])
        lhs = f"{', '.join(returns)} = " if returns else ""
        return lambda is_full: (f"{lhs}{name}({call_args}, IS_FULL={is_full})" if "IS_FULL" in iface.params
                                else f"{lhs}{name}({call_args})")

    def indexed_for(self, st: For, at: tuple[Expr, Expr, Expr]) -> None:
        """Two loops over the host's lists of partial, then full, KV blocks of this tile row in [lo, hi) (on the "q"
        axis: of query blocks of this KV-block column, from the transposed lists qvl)."""
        v = self.local(st.var)
        b = self.ex(at[0]) if self.plan.per_b else "0"
        h = self.ex(at[1]) if self.plan.per_h else "0"
        ax = AXES[self.loop_axis(st)]
        lists, fixed, own, count = ax.lists, ax.fixed_block, ax.step, ax.count
        if ax.name == "q":
            self.sig.q_lists = True
        row, j_lo, j_hi = f"_{lists}_row_{v}", f"_j_lo_{v}", f"_j_hi_{v}"
        what, block = ("KV", "m_block") if ax.name == "kv" else ("query", "n_block")
        self.emit(f"# {what} loop over the host's block lists ({lists}[b, h, {block}, class] = cumulative counts, then block")
        self.emit("# indices): partial blocks, then full blocks (no mask code); empty blocks are never visited")
        self.emit(f"{row} = {lists}_ptr + {wrap(b)} * stride_{lists}_0 + {wrap(h)} * stride_{lists}_1 "
                  f"+ ({wrap(self.ex(at[2]))} // {fixed}) * stride_{lists}_2")
        lo = self.ex(st.lo)
        self.emit(f"{j_lo} = {lo if is_nonneg(st.lo, self.ctx()) else f'tl.maximum({lo}, 0)'} // {own}")
        self.emit(f"{j_hi} = tl.maximum(tl.minimum(tl.cdiv({self.ex(st.hi)}, {own}), {count}), {j_lo})")
        started = self.start_hoist(st)
        call_part = self.outline(st, Sym(v, Kind.INT, True), *(
            Region(st.var, at, frozenset({cls}), ax.name, inside=ax.name == "kv") for cls in (BlockClass.FULL, BlockClass.PARTIAL)))
        for cls in (BlockClass.PARTIAL, BlockClass.FULL):
            lst, it = f"_{lists}_{cls.value}_{v}", f"_i_{cls.value}_{v}"
            self.emit(f"{lst} = {row} + {CLASS_CODE[cls] - PARTIAL} * stride_{lists}_3")
            self.emit(f"for {it} in range(tl.load({lst} + {j_lo} * stride_{lists}_4), tl.load({lst} + {j_hi} * stride_{lists}_4)):")
            self.emit(f"    {v} = tl.load({lst} + ({count} + 1 + {it}) * stride_{lists}_4) * {own}  # {cls.value} blocks")
            self.emit(f"    {call_part(cls is BlockClass.FULL)}")
        self.end_hoist(started)

    def decided(self, st: IfBlock) -> tuple[str, tuple[Stmt, ...]] | None:
        """(a comment saying why, the statements to run) when the region being lowered decides `st` for every block
        of its part, else None (a test per block)."""
        if self.region is None or not self.region.covers(st):
            return None
        holds = self.region.decide(st)
        if holds is not None:
            cond = f"{'not ' if st.negate else ''}block is {st.cls.value}"
            where = "full block" if self.region.full else "block of the partial parts"
            return f"# `{cond}` is {holds != st.negate} in every {where}", st.then if holds != st.negate else st.orelse
        if self.masks_empty_blocks(st):
            return ("# in the partial parts `not block is empty` is left to the mask: an empty block's scores are all "
                    "masked, so it adds 0", st.then)
        return None

    def s_ifblock(self, st: IfBlock) -> None:
        choice = self.decided(st)
        if choice is not None:
            self.emit(choice[0])
            self.statements(choice[1])
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

    def masks_empty_blocks(self, st: IfBlock) -> bool:
        """In a partial part of a split KV-outer query loop, is `if block is not empty` redundant? Its body masks every
        score of a partial block (so of an empty one: P = 0, dS = 0, every product and atomic adds 0). A branch there
        measured costly: the split dK/dV kernel at causal D=128 took 4.97 ms with it, 4.14 without (run 19, H100)."""
        region = self.region
        return region is not None and region.axis == "q" and region.classes == _SPLIT_PARTIAL \
            and st.cls is BlockClass.EMPTY and st.negate and not st.orelse \
            and any(isinstance(x, Mask) or (isinstance(x, IfBlock) and x.cls is BlockClass.FULL and x.negate
                                            and any(isinstance(y, Mask) for y in x.then)) for x in st.then)

    def block_condition(self, st: IfBlock) -> str:
        code = CLASS_CODE[st.cls]
        op = "!=" if st.negate else "=="
        if self.plan.kind is BlockMaskKind.TABLE:
            bq, bk = var("BLOCK_M"), var("BLOCK_N")
            aligned = (st.at.q_start % bq).eq(0) & (st.at.kv_start % bk).eq(0)
            cell = load("__bc", st.at.b if self.plan.per_b else const(0), st.at.h if self.plan.per_h else const(0),
                        st.at.q_start // bq, st.at.kv_start // bk)

            aux = {**self.aux, "__bc": AuxRef("bc_ptr", tuple(f"stride_bc_{i}" for i in range(4)),
                                              ("bc_nb", "bc_nh", "bc_nm", "bc_nn"), Kind.INT)}
            cls = lower_expr(call("where", aligned, cell, const(PARTIAL)), self.ctx(aux=aux))
            self.emit("# block class from the host table (0 empty, 1 partial, 2 full); unaligned tiles are partial")
            self.emit(f"_bclass = {cls}")
            return f"_bclass {op} {code}"
        test = block_class_test(self.plan, st, self.m_dim, self.n_dim)
        self.emit(f"# block class in closed form ({self.plan.kind.value}) for the tile at "
                  f"({strip_parens(self.ex(st.at.q_start))}, {strip_parens(self.ex(st.at.kv_start))})")
        self.emit(f"_is_{st.cls.value} = {self.ex(test)}")
        return f"not _is_{st.cls.value}" if st.negate else f"_is_{st.cls.value}"

    # -- whole kernel
    def axis_value(self, axis: str, index: str) -> str:
        """A grid axis' value from its flat index; packed, the head axis is the group's first query head."""
        if self.pack is not None and axis == self.pack.head:
            return f"{wrap(index)} * ({self.pack.hq} // {self.pack.hkv})"
        return index

    def moved_loop_ends(self, axis: str, stmts: Iterable[Stmt]) -> set[str]:
        """Which ends ("lo", "hi") of the loops among `stmts` depend on grid axis `axis`, through the lets before them."""
        deps: dict[str, set[str]] = {}
        ends: set[str] = set()
        for st in stmts:
            if isinstance(st, Let):
                fv = free_vars(st.value)
                deps[st.name] = set(fv).union(*(deps.get(n, set()) for n in fv))
            elif isinstance(st, For):
                for end, e in (("lo", st.lo), ("hi", st.hi)):
                    fv = free_vars(e)
                    if axis in set(fv).union(*(deps.get(n, set()) for n in fv)):
                        ends.add(end)
        return ends

    def moves_kv_bound(self, axis: str) -> bool:
        """Does a top-level loop's upper bound depend on grid axis `axis` (through lets)?"""
        return "hi" in self.moved_loop_ends(axis, self.k.body)

    def emit_branch(self, head: str, then: Callable[[], None], orelse: str, other: Callable[[], None]) -> None:
        """`head` (an `if CONSTEXPR:` line) over what `then` emits, `orelse` (its `else:` line) over what `other` does."""
        for line, body in ((head, then), (orelse, other)):
            self.emit(line)
            self.depth += 1
            body()
            self.depth -= 1

    def bound_direction(self, axis: str) -> str | None:
        """Which end of the kernel's loops (nested ones too) grid axis `axis` moves: "lo" (a larger index starts later:
        a dK/dV kernel's query loop under a causal-like mask), "hi" (a larger index ends later: a dq pass, a forward),
        None when neither or both (a window: every program about as long)."""
        ends = self.moved_loop_ends(axis, walk_stmts(self.k.body))
        return next(iter(ends)) if len(ends) == 1 else None

    def emit_pid(self, axes: tuple[GridAxis, ...], heavy: bool) -> None:
        """The grid axes from the flat program id `pid`, the last axis fastest (`heavy`: its largest value first)."""
        pk = self.pack
        for a in reversed(axes[1:]):
            ext = wrap(self.ex(pk.extent(a.name, a.extent) if pk else a.extent))
            if heavy and a is axes[-1]:
                self.emit(f"# `{a.name}` moves the KV loop bound: largest {a.name} first, so the launch ends on short programs")
                self.emit(f"{self.local(a.name)} = {ext} - 1 - pid % {ext}")
            else:
                self.emit(f"{self.local(a.name)} = {self.axis_value(a.name, f'pid % {ext}')}")
            self.emit(f"pid = pid // {ext}")
        self.emit(f"{self.local(axes[0].name)} = {self.axis_value(axes[0].name, 'pid')}")

    def emit_pid_longest_first(self, axes: tuple[GridAxis, ...], direction: str) -> None:
        """The grid axes from the flat program id `pid` with the last (block) axis slowest, its longest programs
        first (ascending where it moves the loops' start, descending where it moves their end): every head's longest
        programs start in the first wave."""
        for a in axes[:-1]:
            ext = wrap(self.ex(a.extent))
            self.emit(f"{self.local(a.name)} = pid % {ext}")
            self.emit(f"pid = pid // {ext}")
        last = axes[-1]
        self.emit(f"{self.local(last.name)} = " + ("pid" if direction == "lo" else f"{wrap(self.ex(last.extent))} - 1 - pid"))

    def generate(self) -> list[str]:
        float_scalars = {q.name for q in self.sig.scalars if DTYPE_KIND[q.dtype] is Kind.FLOAT}
        self.fusions = plan_fusions(self.k, float_scalars, fold_scale=self.opts.fold_scale, accumulate=self.backward)
        axes = self.k.grid
        pk = self.pack
        self.emit(f"# grid ({', '.join(f'{a.name}: {a.extent}' for a in axes)}), flattened; the last axis varies fastest")
        if pk is not None:
            self.emit(f"# GQA packed: {pk.head} runs over the {pk.hkv} KV heads, {pk.rows} over cdiv(({pk.hq} // {pk.hkv}) * {pk.m}, "
                      f"BLOCK_M) blocks of (query head in group, query position) rows")
            self.emit(f"_pk_rows = ({pk.hq} // {pk.hkv}) * {pk.m}")
        heavy = self.opts.heavy_first and len(axes) > 1 and self.moves_kv_bound(axes[-1].name)
        direction = self.bound_direction(axes[-1].name) if self.backward and pk is None and len(axes) > 1 else None
        if len(axes) == 1:
            self.emit(f"{self.local(axes[0].name)} = {self.axis_value(axes[0].name, 'tl.program_id(0)')}")
        elif direction is not None:
            # On H100 (MQA, B=8, 4K, D=64: 256 dK/dV programs of 16 heads) the dK/dV kernel ran 2.24 ms head by head
            # and 1.60 ms longest first; with 4096 programs (ALiBi, B=4, H=16, 8K) 9.0 ms and 11.7 ms (L2 reuse
            # lost), so the host asks for it only where the grid is a few waves (`_longest_first`).
            self.sig.heavy_first = True
            self.emit("pid = tl.program_id(0)")
            self.emit_branch("if HEAVY_FIRST:  # a few waves of programs: the longest of every head first",
                             lambda: self.emit_pid_longest_first(axes, direction), "else:",
                             lambda: self.emit_pid(axes, heavy))
        else:
            self.emit("pid = tl.program_id(0)")
            self.emit_pid(axes, heavy)
        for a in axes:
            below = wrap(self.ex(a.extent)) if a.extent.op is ExprOp.VAR else None
            self.names[a.name] = Sym(self.local(a.name), Kind.INT, True, below)
        self.block(self.k.body)
        return self.lines
