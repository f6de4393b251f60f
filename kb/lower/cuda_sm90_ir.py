"""Program -> the Hopper template (kb.lower.cuda_sm90) with its three hooks generated from the IR.

The template keeps FA3's fixed algorithm (TMA producer, two wgmma consumer warpgroups, online
softmax, epilogue); the Program supplies what varies, as Inductor's FlexAttention templates take
score_mod/mask_mod:
- `kb_kv_range`: the prologue `let`s and the bounds of the program's one KV loop;
- `kb_block_kind`: 0 when the loop's `if block(..) is not empty` skips the tile, 1 when some score
  statement acts on its elements, 2 when only `s * sm_scale` does (every mask of a FULL tile keeps
  every score, so a mask counts only where the tile is not provably full: closed form or the
  block-class table, `kb.lower.block_mask.plan_block_mask`);
- `kb_score`: the loop's score statements in order (elementwise on the score, score_mod, masks) on
  one score at (q_idx, kv_idx); `if block(..) is not full: mask` applies unconditionally (a full tile
  keeps every score, so this is exact). Its pieces that read neither the key nor the score go into
  `KbRow` (those of (b, h) alone through `kb_row_head`, of the query through `kb_row_at`), those of the
  key alone into `KbCol` (`kb_col`); `kb_score_at` combines them, and the backward calls each as
  rarely as its step allows.
The kernel reads q/k/v at [b, h // (Hq // Hkv), rows, :] (GQA), so the Program's loads must address
exactly those (checked by evaluating its index expressions), with BLOCK_M = 128 and BLOCK_N the
template's. Host entry: `kb.lower.cuda`'s `kb_launch` ABI (the same `LaunchAbi`), which fills `KbArgs`,
runs the block-class kernel when the program has a table, then `kb_sm90_launch`.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass
from typing import Callable

from kb.errors import KBError
from kb.ir.derive import score_grad
from kb.ir.evaluate import Value, eval_expr
from kb.ir.expr import Expr, ExprOp, free_vars, var
from kb.ir.nodes import (
    BlockClass, Dot, Dtype, Elementwise, For, Full, IfBlock, Init, Kernel, Let, Load, Mask, OnlineSoftmax, Param,
    Program, Role, ScoreMod, Span, Stmt, aux_gradients,
)
from kb.lower.cuda import (
    ERROR_SYMBOL, EXPR_HELPERS, LAUNCH_SYMBOL, CudaKernelGen, LaunchAbi, arg_locals, args_struct, cxx_name, fill_args,
    launch_abi, schedule_constants, table_helpers,
)
from kb.lower.cuda_expr import IntWidth, lower_cexpr
from kb.lower.expr_context import ExprContext, Kind, Sym, expr_kind, is_nonneg
from kb.lower.cuda_range import KB_DIM_LIMIT, KB_ERR_RANGE, Ival, fits32, hoistable, ival, narrow_ints
from kb.ir.text import print_block
from kb.lower.cuda_sm90 import sm90_forward_source
from kb.lower.cuda_sm90_bwd import BWD_LAUNCH_SYMBOL, sm90_backward_source
from kb.lower.block_mask import BlockMaskKind, BlockMaskPlan, plan_block_mask

__all__ = ["lower_program_sm90", "backward_refusal", "hopper_program", "abi_program", "SM90_BLOCK_M", "SM90_BLOCK_N", "SM90_HEAD_DIMS"]

SM90_BLOCK_M = 128
SM90_BLOCK_N = 128
SM90_HEAD_DIMS = (64, 128)
_ROW_ARGS = ("b", "h", "q_idx")  # KbRow's int fields (the launcher refuses dims above KB_DIM_LIMIT)


def _fail(p: Program, what: str) -> KBError:
    return KBError(f"Hopper lowering of {p.name}: {what} is outside the structure it accepts "
                   "(see kb/lower/cuda_sm90_ir.py); the other CUDA lowerings still apply")


def _is_scale(e: Expr, s: str) -> bool:
    """e is `s * sm_scale` (either order)."""
    return e.op is ExprOp.MUL and {str(a.value) for a in e.args if a.op is ExprOp.VAR} == {s, "sm_scale"}


@dataclass(frozen=True)
class _Loop:
    """One KV loop: `for n in range(lo, hi, BLOCK_N): [if block is not empty:] load K, V; dot; scores; online_softmax`."""

    loop: For
    skip: IfBlock | None
    loads: tuple[Load, ...]
    dot: Dot
    scores: tuple[Stmt, ...]


def _parse_loop(p: Program, f: For) -> _Loop:
    body: tuple[Stmt, ...] = f.body
    skip = None
    if len(body) == 1 and isinstance(body[0], IfBlock) and body[0].cls is BlockClass.EMPTY and body[0].negate \
            and not body[0].orelse:
        skip, body = body[0], body[0].then
    if len(body) < 4 or str(f.step) != "BLOCK_N":
        raise _fail(p, f"the body of `for {f.var}`")
    loads, dot = tuple(s for s in body[:2] if isinstance(s, Load)), body[2]
    if len(loads) != 2 or not isinstance(dot, Dot) or not isinstance(body[-1], OnlineSoftmax):
        raise _fail(p, f"the body of `for {f.var}`")
    return _Loop(f, skip, loads, dot, body[3:-1])


def _scores_text(lp: _Loop) -> str:
    """The loop's score statements as IR text, the loop variable written `@n` (equal text = equal statements)."""
    lines: list[str] = []
    print_block(lp.scores, 0, lines)
    return re.sub(rf"\b{re.escape(lp.loop.var)}\b", "@n", "\n".join(lines))


class _Shape:
    """The flash forward the template computes, taken apart: lets, KV loops with one set of score statements."""

    def __init__(self, p: Program) -> None:
        if len(p.kernels) != 1:
            raise _fail(p, "more than one kernel")
        k = p.kernels[0]
        if [a.name for a in k.grid] != ["b", "h", "m"]:
            raise _fail(p, "a grid other than (b, h, m)")
        fors = [i for i, s in enumerate(k.body) if isinstance(s, For)]
        if not fors:
            raise _fail(p, "a program without a KV loop")
        tail = [type(s).__name__ for s in k.body[fors[-1] + 1:]]
        if tail != ["Finalize", "Store", "Store"] or any(not isinstance(s, (Let, Load, Init, For)) for s in k.body[:fors[-1]]):
            raise _fail(p, "the statements around the KV loops")
        self.lets = [s for s in k.body if isinstance(s, Let)]
        self.loops = [_parse_loop(p, s) for s in k.body if isinstance(s, For)]
        first = self.loops[0]
        if any(_scores_text(lp) != _scores_text(first) or lp.dot.out != first.dot.out for lp in self.loops[1:]):
            raise _fail(p, "KV loops with different score statements")
        self.scores, self.s = first.scores, first.dot.out
        self.q_load = next((s for s in k.body if isinstance(s, Load)), None)


def _check_addresses(p: Program, shape: _Shape) -> None:
    """q[b, h, m*BLOCK_M:+BLOCK_M, :] and k/v[b, h // (Hq // Hkv), n:+BLOCK_N, :], and the score statements at the
    tile (m*BLOCK_M, n), checked on sample values of the dims."""
    if shape.q_load is None or shape.q_load.tensor != "q":
        raise _fail(p, "a program whose first load is not q")
    for lp in shape.loops:
        loads = [(shape.q_load, "BLOCK_M")] + [(ld, "BLOCK_N") for ld in lp.loads]
        if {ld.tensor for ld in lp.loads} != {"k", "v"}:
            raise _fail(p, "KV loads of tensors other than k and v")
        addresses = [(ld.tensor, _row_address(p, ld, rows)) for ld, rows in loads]
        for Hq, Hkv in ((8, 8), (8, 2), (8, 1), (6, 3)):
            for b, h, m, n in itertools.product((0, 1), range(Hq), (0, 3), (0, 256)):
                env: dict[str, Value] = {"B": 2, "Hq": Hq, "Hkv": Hkv, "M": 1000, "N": 1000, "D": 64,
                                         "BLOCK_M": SM90_BLOCK_M, "BLOCK_N": SM90_BLOCK_N, "b": b, "h": h, "m": m}
                for let in shape.lets:
                    env[let.name] = eval_expr(let.value, env)
                want = {"q": (b, h, m * SM90_BLOCK_M), "k": (b, h // (Hq // Hkv), n), "v": (b, h // (Hq // Hkv), n)}
                env[lp.loop.var] = n
                for st in _element_stmts(lp.scores):  # the kernel's q_idx/kv_idx are the tile's rows and columns
                    if (int(eval_expr(st.at.q_start, env)), int(eval_expr(st.at.kv_start, env))) != (m * SM90_BLOCK_M, n):
                        raise _fail(p, f"{st.op.value} at ({st.at.q_start}, {st.at.kv_start})")
                for tensor, address in addresses:
                    if tuple(int(eval_expr(e, env)) for e in address) != want[tensor]:
                        raise _fail(p, f"the rows/heads {tensor}[...] addresses (expected b, h // (Hq // Hkv), "
                                       "m * BLOCK_M or the loop variable)")


def _row_address(p: Program, ld: Load, rows: str) -> tuple[Expr, Expr, Expr]:
    """(batch, head, first row) of `ld`, which must read `t[b, h, start:+rows, :]`."""
    b, h, span, full = ld.index if len(ld.index) == 4 else (None,) * 4
    if not isinstance(b, Expr) or not isinstance(h, Expr) or not isinstance(span, Span) or str(span.size) != rows \
            or not isinstance(full, Full):
        raise _fail(p, f"the index of {ld.tensor}[...]")
    return b, h, span.start


def _element_stmts(stmts: tuple[Stmt, ...]) -> list[ScoreMod | Mask]:
    out: list[ScoreMod | Mask] = []
    for st in stmts:
        if isinstance(st, (ScoreMod, Mask)):
            out.append(st)
        elif isinstance(st, IfBlock):
            out += _element_stmts(st.then + st.orelse)
    return out


class _HookGen(CudaKernelGen):
    """Emits the three hook functions with `CudaKernelGen`'s expression, let and block-class machinery."""

    def __init__(self, p: Program, k: Kernel, abi: LaunchAbi, plan: BlockMaskPlan) -> None:
        super().__init__(p, k, abi, plan)
        self.base_names = dict(self.names)  # the dims, schedule constants and scalars: what every hook starts from
        self.fields: list[_Field] = []  # KbRow's pieces, hoisted while kb_score's statements are emitted
        self.cols: list[_Field] = []  # KbCol's: pieces of one key, free of the query row and the score

    def body(self, lines_from: Callable[[], None]) -> list[str]:
        """One hook's lines (`lines_from` emits them): names start again from the dims, schedule constants and scalars."""
        self.names = dict(self.base_names)
        self.lines, self.depth, self.scopes = [], 1, [set()]
        lines_from()
        return self.lines

    def prologue(self, shape: _Shape) -> None:
        """b, h, m (from m_start) and the program's lets, as in the kernel."""
        for n in ("b", "h"):
            self.names[n] = Sym(n, Kind.INT, True)
        self.emit("[[maybe_unused]] const long long m = kb_m_start / BLOCK_M;")
        self.names["m"] = Sym("m", Kind.INT, True)
        for let in shape.lets:
            self.bind_scalar(let.name, let.value)

    def needs_mask(self, st: Mask) -> str:
        """C++ bool: this mask can drop a score of the tile at n_start (False only where the tile is provably full)."""
        if not st.use_mask_mod or (self.plan.kind is BlockMaskKind.TABLE and self.abi.table is None):
            return "true" if st.use_mask_mod else "false"
        guard = IfBlock(BlockClass.FULL, True, st.at, ())
        return self.block_condition(guard)

    def score_stmt(self, st: Stmt, s: str) -> None:
        """Emit `st` on the one score `kb_s` at (q_idx, kv_idx)."""
        if isinstance(st, IfBlock):
            if st.cls is not BlockClass.FULL or not st.negate or st.orelse or \
                    not all(isinstance(x, Mask) for x in st.then):
                raise _fail(self.p, f"`if block(..) is {'not ' if st.negate else ''}{st.cls.value}` around {st.then}")
            for x in st.then:
                self.score_stmt(x, s)
        elif isinstance(st, Elementwise):
            if st.out != s or (free_vars(st.value) & {n for n in self.tiles}) - {s}:
                raise _fail(self.p, f"elementwise {st.out}")
            ctx = self.ctx({**self.names, s: Sym("kb_s", Kind.FLOAT)})
            value = lower_cexpr(st.value, ctx)
            self.emit(f"kb_s = {value if expr_kind(st.value, ctx) is Kind.FLOAT else f'(float)({value})'};")
        elif isinstance(st, ScoreMod) and self.p.score_mod is not None and st.tile == s:
            value, kind = self.element(self.p.score_mod.body, st)
            self.emit(f"kb_s = {value if kind is Kind.FLOAT else f'(float)({value})'};")
        elif isinstance(st, Mask) and st.tile == s and not st.use_mask_mod:
            pass  # kv_idx < N: the kernel masks it itself
        elif isinstance(st, Mask) and st.tile == s and self.p.mask_mod is not None:
            self.emit(f"if (!({self.element(self.p.mask_mod.body, st)[0]})) kb_s = -INFINITY;")
        else:
            raise _fail(self.p, f"the score statement {type(st).__name__}")

    def element(self, e: Expr, st: ScoreMod | Mask) -> tuple[str, Kind]:
        """`e` for kb_score_at, with its pieces that depend on neither kv_idx nor the score moved into KbRow (the
        forward computes a row once per CTA and thread row: the template's rows never change; the backward the pieces
        of its step's head once, `kb_row_head`) and those of kv_idx alone into KbCol; (C++ code, kind)."""
        if str(st.at.b) != "b" or str(st.at.h) != "h" or st.at.head_rows:
            raise _fail(self.p, f"{st.op.value} at ({st.at.b}, {st.at.h}, ..) (b and h are accepted)")
        row = {**self.names, **{n: Sym(n, Kind.INT, True) for n in (*_ROW_ARGS, "kv_idx")},
               "score": Sym("kb_s", Kind.FLOAT)}
        rctx = self.ctx(row)
        body = self.hoist(e, rctx)
        elem = {**row, **{n: Sym(f"r.{n}", Kind.INT, True) for n in _ROW_ARGS},
                **{f.name: Sym(f"r.{f.name}", f.kind, f.nonneg) for f in self.fields},
                **{f.name: Sym(f"c.{f.name}", f.kind, f.nonneg) for f in self.cols}}
        ctx = self.ctx(elem)
        return lower_cexpr(body, ctx, self.width(ctx, {f"r.{n}" for n in _ROW_ARGS} | {"kv_idx"})), expr_kind(body, ctx)

    def hoist(self, e: Expr, ctx: ExprContext) -> Expr:
        """`e` with each largest piece free of the score (and safe to evaluate eagerly) and of kv_idx or of q_idx
        replaced by a KbRow or a KbCol field; the fields' code is lowered for kb_row_head / kb_row_at or kb_col."""
        used = free_vars(e)
        if e.op not in (ExprOp.CONST, ExprOp.VAR) and "score" not in used and not {"kv_idx", "q_idx"} <= used \
                and hoistable(e, lambda x: expr_kind(x, ctx)):
            kind = expr_kind(e, ctx)
            rng = ival(e, self.env(), self.aux_types()) if kind is Kind.INT else None
            ctype = {Kind.FLOAT: "float", Kind.BOOL: "bool"}.get(kind) or ("int" if rng is not None and fits32(rng) else "long long")
            fields, prefix = (self.fields, "kb_r") if "kv_idx" not in used else (self.cols, "kb_c")
            name = f"{prefix}{len(fields)}"
            code = lower_cexpr(e, ctx, self.width(ctx, {"b", "h", "q_idx", "kv_idx"}))
            fields.append(_Field(name, kind, ctype, code, is_nonneg(e, ctx) if kind is Kind.INT else False, rng,
                                 "q_idx" not in used))
            return var(name)

        return Expr(e.op, tuple(self.hoist(a, ctx) for a in e.args), e.value) if e.args else e

    def env(self) -> dict[str, Ival]:
        """Bounds of the names the hooks' integers are built from: dims, KbRow's ints and kv_idx, the hoisted fields."""
        env: dict[str, Ival] = {d: (0, KB_DIM_LIMIT) for d in self.abi.dims}
        env.update({n: (0, KB_DIM_LIMIT) for n in (*_ROW_ARGS, "kv_idx")})
        env.update({f.name: f.range for f in (*self.fields, *self.cols) if f.range is not None})
        return env

    def aux_types(self) -> dict[str, Dtype]:
        return {t.name: t.dtype for t in self.abi.tensors if t.role is Role.AUX}

    def width(self, ctx: ExprContext, int_codes: set[str]) -> IntWidth:
        """32-bit integers wherever the value provably fits: the launcher refuses dims above KB_DIM_LIMIT
        (64-bit integer ops are emulated on the GPU); `int_codes`: the names already `int`."""
        ints = int_codes | {f"r.{f.name}" for f in self.fields if f.ctype == "int"} | \
            {f"c.{f.name}" for f in self.cols if f.ctype == "int"}
        return IntWidth(narrow_ints(self.env(), self.aux_types(), lambda a: expr_kind(a, ctx)), frozenset(ints))

    def row_hooks(self, locs: list[str]) -> list[str]:
        """struct KbRow (b, h, q_idx and the hoisted pieces of one query row) and struct KbCol (kv_idx and those of
        one key), with kb_row_head (the pieces of (b, h) alone), kb_row_at (then those of q_idx), kb_row (both) and
        kb_col; `locs` declare the dims and scalars."""
        head = [f for f in self.fields if f.head]
        at = [f for f in self.fields if not f.head]
        dims = "  // in range of int: the launcher refuses dims above KB_DIM_LIMIT"
        return [
            "struct KbRow {", "  int b, h, q_idx;", *(f"  {f.ctype} {f.name};" for f in self.fields), "};",
            "__device__ __forceinline__ KbRow kb_row_head(const KbArgs& kb_a, long long kb_b, long long kb_h) {", dims,
            "  [[maybe_unused]] const int b = (int)kb_b, h = (int)kb_h;",
            *locs, "  KbRow r{};", "  r.b = b; r.h = h;", *(f"  r.{f.name} = {f.code};" for f in head), "  return r;",
            "}",
            "__device__ __forceinline__ KbRow kb_row_at(const KbArgs& kb_a, KbRow r, long long kb_q) {", dims,
            "  [[maybe_unused]] const int b = r.b, h = r.h, q_idx = (int)kb_q;",
            *(locs if at else []), "  r.q_idx = q_idx;", *(f"  r.{f.name} = {f.code};" for f in at), "  return r;",
            "}",
            "__device__ __forceinline__ KbRow kb_row(const KbArgs& kb_a, long long kb_b, long long kb_h, long long kb_q) {",
            "  return kb_row_at(kb_a, kb_row_head(kb_a, kb_b, kb_h), kb_q);", "}",
            "struct KbCol {", "  int kv_idx;", *(f"  {f.ctype} {f.name};" for f in self.cols), "};",
            "__device__ __forceinline__ KbCol kb_col(const KbArgs& kb_a, long long kb_b, long long kb_h, long long kb_kv) {",
            dims, "  [[maybe_unused]] const int b = (int)kb_b, h = (int)kb_h, kv_idx = (int)kb_kv;",
            *(locs if self.cols else []), "  KbCol c;", "  c.kv_idx = kv_idx;",
            *(f"  c.{f.name} = {f.code};" for f in self.cols), "  return c;", "}"]


@dataclass(frozen=True)
class _Field:
    """A KbRow or KbCol field: a piece of a score statement computed once per query row or key."""

    name: str
    kind: Kind
    ctype: str
    code: str  # C++ in kb_row's scope
    nonneg: bool
    range: Ival | None
    head: bool  # free of q_idx too: computed once per (b, h) by kb_row_head


def _hooks(p: Program, shape: _Shape, abi: LaunchAbi, scalars: list[Param]) -> str:
    plan = plan_block_mask(p)
    g = _HookGen(p, p.kernels[0], abi, plan)
    g.tiles[shape.s] = None  # type: ignore[assignment]  # the score is a tile name, never a scalar
    head = "(const KbArgs& kb_a, long long b, long long h, long long kb_m_start"
    locs = arg_locals(abi, scalars)
    bounds = [(f"kb_lo{i}", f"kb_hi{i}") for i in range(len(shape.loops))]

    def kv_range() -> None:
        g.prologue(shape)
        for (lo, hi), lp in zip(bounds, shape.loops):
            g.emit(f"const long long {lo} = {g.ex(lp.loop.lo)}, {hi} = {g.ex(lp.loop.hi)};")
        g.emit("kb_lo = 0x7fffffffffffffffLL; kb_hi = -0x7fffffffffffffffLL;  // the union of the loops that run")
        for lo, hi in bounds:
            g.emit(f"if ({lo} < {hi}) {{ kb_lo = kb_min(kb_lo, {lo}); kb_hi = kb_max(kb_hi, {hi}); }}")
        g.emit("if (kb_lo > kb_hi) { kb_lo = 0; kb_hi = 0; }")
        g.emit("// the kernel walks tiles kb_lo + k * BLOCK_N from kb_lo >= 0; a loop off that grid would be a wrong")
        g.emit("// answer, so it stops the kernel (a launch error) instead")
        for lo, hi in bounds:
            g.emit(f"if ({lo} < {hi} && ({lo} < 0 || kb_floormod({lo} - kb_lo, BLOCK_N) != 0)) __trap();")

    def scores() -> None:
        for st in shape.scores:
            g.score_stmt(st, shape.s)

    kv = g.body(kv_range)
    score_lines = g.body(scores)
    kind_lines = g.body(lambda: _kind_lines(g, shape, bounds))
    return "\n".join([
        f"__device__ __forceinline__ void kb_kv_range{head}, long long& kb_lo, long long& kb_hi) {{",
        *locs, *kv, "}",
        f"__device__ __forceinline__ int kb_block_kind{head}, long long kb_n_start) {{",
        *locs, *kind_lines, "}",
        *g.row_hooks(locs),
        "__device__ __forceinline__ float kb_score_at(const KbArgs& kb_a, const KbRow& r, const KbCol& c, float kb_s) {",
        "  [[maybe_unused]] const int kv_idx = c.kv_idx;",
        *locs, *score_lines, "  return kb_s;", "}",
        "__device__ __forceinline__ float kb_score(const KbArgs& kb_a, const KbRow& r, long long kb_kv, float kb_s) {",
        "  return kb_score_at(kb_a, r, kb_col(kb_a, r.b, r.h, kb_kv), kb_s);", "}"])


def _kind_lines(g: "_HookGen", shape: _Shape, bounds: list[tuple[str, str]]) -> None:
    """kb_block_kind's body: the loop that visits the tile decides (skip test, then whether a score statement acts)."""
    g.prologue(shape)
    for (lo, hi), lp in zip(bounds, shape.loops):
        g.names[lp.loop.var] = Sym("kb_n_start", Kind.INT, True)
        g.emit(f"const long long {lo} = {g.ex(lp.loop.lo)}, {hi} = {g.ex(lp.loop.hi)};")
        with g.indent(f"if ({lo} <= kb_n_start && kb_n_start < {hi} && kb_floormod(kb_n_start - {lo}, BLOCK_N) == 0)"):
            if lp.skip is not None:
                g.emit(f"if (!({g.block_condition(lp.skip)})) return 0;  // the loop skips empty tiles")
            kinds, masks = _acting(g, lp)
            if kinds:
                g.emit("return 1;  // a score statement acts on every tile")
            else:
                tests = [g.needs_mask(m) for m in masks]
                g.emit(f"return ({' || '.join(tests) or 'false'}) ? 1 : 2;")
        g.names.pop(lp.loop.var)
    g.emit("return 0;  // no loop visits this tile")


def _acting(g: "_HookGen", lp: _Loop) -> tuple[bool, list[Mask]]:
    """(whether a statement other than `s * sm_scale` and masks acts on every element, the loop's mask_mod masks)."""
    always, masks = False, []
    for st in _flat(lp.scores):
        if isinstance(st, Elementwise):
            always |= not _is_scale(st.value, st.out)
        elif isinstance(st, ScoreMod):
            always = True
        elif isinstance(st, Mask) and st.use_mask_mod:
            masks.append(st)
    return always, masks


def _flat(stmts: tuple[Stmt, ...]) -> list[Stmt]:
    out: list[Stmt] = []
    for st in stmts:
        out += _flat(st.then + st.orelse) if isinstance(st, IfBlock) else [st]
    return out


def backward_refusal(fwd: Program, bwd: Program) -> str | None:
    """Why the Hopper backward (kb.lower.cuda_sm90_bwd) cannot stand in for backward program `bwd` of `fwd`; None when
    it can. It computes dS -> d(q.k) as `dS * sm_scale` and no aux gradient, so every score statement must be
    `s * sm_scale`, a score_mod whose derivative in the score is 1 (added terms: ALiBi, a fixed bias) or a mask."""
    if aux_gradients(bwd):
        return f"it has aux gradients ({', '.join(aux_gradients(bwd).values())}), which the Hopper backward does not compute"
    try:
        scores = _flat(_Shape(fwd).scores)
    except KBError as err:
        return str(err)
    for st in scores:
        if isinstance(st, Elementwise) and not _is_scale(st.value, st.out):
            return f"the score statement `elementwise {st.out}` is not `s * sm_scale`"
        if isinstance(st, ScoreMod) and fwd.score_mod is not None:
            grad = score_grad(fwd.score_mod.body)
            if grad.op is not ExprOp.CONST or grad.value != 1:
                return "its score_mod's derivative in the score is not 1"
    return None


_IO = ("q", "k", "v", "o")
_SOURCE_MARK = "// Hopper (sm_90a) kernel for IR program"  # a Hopper source's first line (abi_program)


def hopper_program(p: Program) -> Program:
    """`p` as the Hopper template computes it, q, k, v and o in one 16-bit type: a program typed fp32 throughout (a
    spec traced in fp32, whose Triton module follows the inputs' dtype) becomes its bf16 copy, what its module runs
    when a user passes bf16; fp32 inputs keep the Triton kernels (the `.cu`'s dispatch compares dtypes)."""
    names = {x.name for x in p.params}
    if not set(_IO) <= names or any(p.param(t).dtype is not Dtype.F32 for t in _IO):
        return p
    return dataclasses.replace(p, params=tuple(dataclasses.replace(x, dtype=Dtype.BF16) if x.name in _IO else x
                                               for x in p.params))


def abi_program(p: Program, source: str) -> Program:
    """The program whose launch ABI (kb.lower.cuda.launch_abi: dtypes included) `source`, a `.cu` lowered from `p`,
    has: `hopper_program(p)` for the Hopper template's, `p` for the other lowerings'."""
    return hopper_program(p) if source.startswith(_SOURCE_MARK) else p


def lower_program_sm90(p: Program, head_dim: int, backward: bool = False) -> str:
    """The Hopper (sm_90a) source for `hopper_program(p)` at head dim `head_dim` (64 or 128; the kernel refuses
    another D at launch); KBError when `p` is outside the structure above. `backward`: the file also holds the Hopper
    backward (kb.lower.cuda_sm90_bwd) and its `kb_launch_bwd`; ask `backward_refusal(p, bwd)` first."""
    if head_dim not in SM90_HEAD_DIMS:
        raise KBError(f"Hopper lowering of {p.name}: head dim {head_dim} (the template has {SM90_HEAD_DIMS})")
    p = hopper_program(p)
    q = p.param("q")
    if q.dtype not in (Dtype.BF16, Dtype.F16) or any(p.param(t).dtype is not q.dtype for t in ("k", "v", "o")):
        raise KBError(f"Hopper lowering of {p.name}: q, k, v and o must all be bf16 or all fp16 "
                      f"(got q {q.dtype.value}, o {p.param('o').dtype.value}; the kernel stores o in q's type)")
    want = {"q": ("B", "Hq", "M", "D"), "k": ("B", "Hkv", "N", "D"), "v": ("B", "Hkv", "N", "D"),
            "o": ("B", "Hq", "M", "D"), "lse": ("B", "Hq", "M")}
    names = {x.name for x in p.params}
    if not set(want) <= names or any(tuple(map(str, p.param(t).shape)) != dims for t, dims in want.items()):
        raise KBError(f"Hopper lowering of {p.name}: needs q, k, v, o, lse shaped [B, Hq|Hkv, M|N, D] (one head dim)")
    if any(x.role in (Role.OUT, Role.SCRATCH) and x.name not in ("o", "lse") for x in p.params):
        raise KBError(f"Hopper lowering of {p.name}: outputs other than o and lse")
    p = dataclasses.replace(p, schedule=dataclasses.replace(p.schedule, block_m=SM90_BLOCK_M, block_n=SM90_BLOCK_N,
                                                            num_warps=4))
    shape = _Shape(p)
    _check_addresses(p, shape)
    abi = launch_abi(p)
    scalars = [x for x in p.params if x.role is Role.SCALAR]
    dtype = "bf16" if q.dtype is Dtype.BF16 else "fp16"
    consts = schedule_constants(p.schedule)  # KB_THREADS: the block-class kernel's
    hooks = "\n".join([EXPR_HELPERS, *consts, *args_struct(abi), *(table_helpers(p, abi, 128) if abi.table else []),
                       _hooks(p, shape, abi, scalars)])
    src = sm90_forward_source(hooks, head_dim_pad=head_dim, block_m=SM90_BLOCK_M, block_n=SM90_BLOCK_N, dtype=dtype)
    if backward:
        src += sm90_backward_source(head_dim_pad=head_dim, dtype=dtype)
    out = [f"{_SOURCE_MARK} `{p.name}` at D={head_dim}: kb.lower.cuda_sm90 with hooks from "
           "the IR (kb.lower.cuda_sm90_ir), do not edit. Build with -gencode=arch=compute_90a,code=sm_90a.",
           src, *_host(abi, backward)]
    return "\n".join(out).rstrip() + "\n"


def _host(abi: LaunchAbi, backward: bool) -> list[str]:
    """`kb_launch` with the portable ABI (fill KbArgs, block classes first when there is a table, then the kernel) and,
    with `backward`, `kb_launch_bwd`: the same arguments, then the backward's (kb.lower.cuda_sm90_bwd.BWD_LAUNCH_SYMBOL)."""
    L = ["static int kb_prepare(KbArgs& kb_a, void* const* ptrs, const long long* strides, const long long* dims, "
         "const double* scalars, void* stream) {", *fill_args(abi)]
    if abi.table:
        L += ["  cudaStream_t kb_stream = static_cast<cudaStream_t>(stream);",
              "  const long long kb_cells = kb_a.bc_size[0] * kb_a.bc_size[1] * kb_a.bc_size[2] * kb_a.bc_size[3];",
              "  if (kb_cells > 0) kb_block_class_kernel<<<(unsigned)kb_cells, KB_THREADS, 0, kb_stream>>>(kb_a, "
              "const_cast<signed char*>(kb_a.bc));",
              "  cudaError_t kb_err = cudaGetLastError();",
              "  if (kb_err != cudaSuccess) return (int)kb_err;"]
    else:
        L += ["  (void)stream;"]
    too_big = " || ".join(f"kb_a.{cxx_name(d)} > {KB_DIM_LIMIT}LL" for d in abi.dims) or "false"
    L += [f"  if ({too_big}) return {KB_ERR_RANGE};  // the hooks' 32-bit index math needs dims <= {KB_DIM_LIMIT}",
          "  return 0;", "}", "",
          f'extern "C" int {LAUNCH_SYMBOL}(void* const* ptrs, const long long* strides, const long long* dims, '
          "const double* scalars, void* stream) {", "  KbArgs kb_a;",
          "  const int kb_rc = kb_prepare(kb_a, ptrs, strides, dims, scalars, stream);",
          "  return kb_rc != 0 ? kb_rc : kb_sm90_launch(&kb_a, stream);", "}", ""]
    if backward:
        L += [f'extern "C" int {BWD_LAUNCH_SYMBOL}(void* const* ptrs, const long long* strides, const long long* dims, '
              "const double* scalars, void* const* gptrs, const long long* gstrides, int o_f32, void* stream) {",
              "  KbArgs kb_a;",
              "  const int kb_rc = kb_prepare(kb_a, ptrs, strides, dims, scalars, stream);",
              "  if (kb_rc != 0) return kb_rc;",
              "  KbBwdArgs g;",
              "  g.o = gptrs[0]; g.o_f32 = o_f32;",
              "  g.dout = static_cast<const kb_elem*>(gptrs[1]);",
              "  g.dq = static_cast<kb_elem*>(gptrs[2]); g.dk = static_cast<kb_elem*>(gptrs[3]);",
              "  g.dv = static_cast<kb_elem*>(gptrs[4]);",
              "  g.dq_acc = static_cast<float*>(gptrs[5]); g.delta = static_cast<float*>(gptrs[6]);",
              "  g.lse2 = static_cast<float*>(gptrs[7]);",
              "  for (int i = 0; i < 4; ++i) {",
              "    g.o_stride[i] = gstrides[i]; g.do_stride[i] = gstrides[4 + i]; g.dq_stride[i] = gstrides[8 + i];",
              "    g.dk_stride[i] = gstrides[12 + i]; g.dv_stride[i] = gstrides[16 + i];",
              "  }",
              "  return kb_sm90_bwd_launch(&kb_a, &g, stream);", "}", ""]
    L += [f'extern "C" const char* {ERROR_SYMBOL}(int code) {{',
          f'  if (code == {KB_ERR_RANGE}) return "the Hopper kernel needs every dim <= {KB_DIM_LIMIT}";',
          "  return kb_sm90_error_string(code);", "}"]
    return L
