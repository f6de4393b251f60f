"""Static checks of a Program, kept apart from construction (tinygrad `uop/spec.py` style).

`validate(p)` raises one `KBError` listing every problem; `problems(p)` returns them.
The rules are kept apart: `PROGRAM_RULES` (a table of whole-program checks) and `StmtRules` (one method
per statement kind, a `kb.ir.visit.StmtVisitor`, run while walking each kernel body with the names in
scope). Invariants the rules state:
- Scope: scalars are the program's symbolic dims, scalar params, schedule constants, grid axes,
  `let` names and loop variables; tiles are the outputs of load/init/dot/elementwise/reduce/
  online_softmax/finalize/combine. One namespace: a name is never both a tile and a scalar,
  and never shadows a param, dim or schedule constant.
- Backward statements: `probs`/`softmax_grad` take a row vector [R] of their [R, C] tile;
  `score_mod_grad`/`aux_grad` take a gradient tile and the score_mod input of one shape; `aux_grad`
  names an aux tensor score_mod reads and an f32 out param of its shape (and, centred, the row
  vector of its tiles); `+=` stores target f32.
- Names defined inside a `for` body are local to it; names defined in both branches of an
  `if` are visible after it.
- Index forms: a span's `until` is an integer scalar expression; a gathered axis
  `[index for var in range(size) if valid]` binds `var` for `index` and `valid` only (it shadows
  nothing in scope), `index` is an integer and `valid` a boolean expression over scalars and `var`.
- Tile shapes are tracked symbolically (span and gather sizes, HEAD_PAD for a full head dim `D`,
  HEAD_PAD_V for a full value head dim `Dv`, the dim name otherwise); two different names never match, a name and an int match when the
  schedule fixes the name to that int or leaves it unknown.
- A problem is located as `kernel K, statement N (TEXT)`, N counting the kernel's statement
  lines from 1 in printed order.
"""

from __future__ import annotations

import keyword
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kb.errors import KBError
from kb.ir.algebra import is_pow2, next_pow2
from kb.ir.expr import CALLS, Expr, ExprOp, walk
from kb.ir.nodes import (
    AuxGrad, BlockClass, Combine, Dim, Dot, Dtype, Elementwise, Finalize, For, Full, Gather, IfBlock, Init, Kernel,
    Let, Load, Mask, OnlineSoftmax, Param, Probs, Program, Reduce, Role, Schedule, ScoreMod, ScoreModGrad,
    SoftmaxGrad, Span, Stmt, Store, TileAt, VariantFn, MASK_MOD_PARAMS, SCHEDULE_CONSTANTS, SCORE_MOD_PARAMS, VALUE_DIM,
)
from kb.ir.text import print_stmt_header
from kb.ir.visit import StmtVisitor, stmt_op

__all__ = ["validate", "problems", "Problem", "PROGRAM_RULES", "StmtRules"]

SymDim = Dim | None  # None: unknown
Shape = tuple[SymDim, ...]


@dataclass(frozen=True)
class Problem:
    where: str  # "program P", "kernel K, statement N (TEXT)", "score_mod", ...
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class _Env:
    """Names in scope while walking one kernel body (mutable, internal to the walk)."""

    program: Program
    kernel: str
    scalars: set[str]
    tiles: dict[str, Shape | None]  # None: shape unknown (an earlier problem was reported)
    counter: list[int] = field(default_factory=lambda: [0])  # shared by child scopes

    def child(self) -> "_Env":
        return _Env(self.program, self.kernel, set(self.scalars), dict(self.tiles), self.counter)


# ================================================================ helpers


def _params(p: Program) -> dict[str, Param]:
    return {prm.name: prm for prm in p.params}


def _base_scalars(p: Program) -> set[str]:
    scalars = {prm.name for prm in p.params if prm.role is Role.SCALAR}
    return set(p.dims()) | scalars | set(SCHEDULE_CONSTANTS)


def _reserved(p: Program) -> set[str]:
    """Names a kernel may not (re)define."""
    return {prm.name for prm in p.params} | set(p.dims()) | set(SCHEDULE_CONSTANTS)


def _const_value(name: str, s: Schedule) -> int | None:
    values = {**s.tile_constants(), "HEAD_PAD": s.fixed_head_pad}
    return values.get(name)


def _same(a: SymDim, b: SymDim, s: Schedule) -> bool:
    """False only when the two dims are known to differ."""
    if a is None or b is None or a == b:
        return True
    if isinstance(a, str) and isinstance(b, str):
        return False
    name, num = (a, b) if isinstance(a, str) else (b, a)
    known = _const_value(str(name), s)
    return known is None or known == num


def _shape_str(shape: Shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _expr_problems(e: object, env_scalars: set[str], tiles: dict[str, Shape | None], p: Program,
                   *, allow_tiles: bool, aux_only: bool = False) -> Iterator[str]:
    """Well-formedness and scope of one expression."""
    if not isinstance(e, Expr):
        yield f"{e!r} is not an expression"
        return
    params = _params(p)
    for n in walk(e):
        if not isinstance(n, Expr) or not isinstance(n.op, ExprOp):
            yield f"unknown expression node {n!r}"
            return
        if n.op is ExprOp.CONST:
            if not isinstance(n.value, (int, float, bool)) or (isinstance(n.value, float) and math.isnan(n.value)):
                yield f"bad constant {n.value!r}"
        elif n.op is ExprOp.VAR:
            name = str(n.value)
            if name in tiles and not allow_tiles:
                yield f"tile '{name}' used where a scalar is needed"
            elif name not in env_scalars and name not in tiles:
                yield f"undefined name '{name}'"
        elif n.op is ExprOp.LOAD:
            yield from _load_expr_problems(n, params, aux_only)
        else:
            want = CALLS[n.op.value][1] if n.op.value in CALLS else 1 if n.op in (ExprOp.NEG, ExprOp.NOT) else 2
            if len(n.args) != want:
                yield f"{n.op.value} takes {want} operands, got {len(n.args)}"


def _load_expr_problems(n: Expr, params: dict[str, Param], aux_only: bool) -> Iterator[str]:
    name = str(n.value)
    prm = params.get(name)
    if prm is None:
        yield f"tensor '{name}' is not a param"
    elif prm.role is Role.SCALAR:
        yield f"'{name}' is a scalar param and cannot be indexed"
    elif aux_only and prm.role is not Role.AUX:
        yield f"variant functions read aux tensors only; '{name}' is {prm.role.value}"
    elif len(n.args) != len(prm.shape):
        yield f"'{name}' has rank {len(prm.shape)} but is indexed with {len(n.args)} indices"


def _scalar_exprs(env: _Env, *exprs: object) -> Iterator[str]:
    for e in exprs:
        yield from _expr_problems(e, env.scalars, env.tiles, env.program, allow_tiles=False)


def _tile_at(env: _Env, at: object, head_rows_ok: bool = False) -> Iterator[str]:
    if not isinstance(at, TileAt):
        yield f"tile coordinates must be a TileAt(b, h, q_start, kv_start), got {at!r}"
        return
    if at.head_rows and not head_rows_ok:
        yield "tile rows as query heads (`heads h`) only where a score_mod or mask is applied"
    yield from _scalar_exprs(env, *at)


def _need_tiles(env: _Env, **names: str) -> Iterator[str]:
    for role, name in names.items():
        if name not in env.tiles:
            what = "a scalar, not a tile" if name in env.scalars else "not defined"
            yield f"{role} '{name}' is {what}"


def _size_problems(size: object) -> Iterator[str]:
    if isinstance(size, bool) or not (isinstance(size, str) and size in SCHEDULE_CONSTANTS
                                      or isinstance(size, int) and size > 0):
        yield f"span size {size!r} must be a schedule constant ({', '.join(SCHEDULE_CONSTANTS)}) or a positive int"


def _index_shape(prm: Param, index: tuple, s: Schedule) -> Shape:
    """Symbolic shape of the tile addressed by `index` into `prm` (scalar indices drop a dim)."""
    out: list[SymDim] = []
    for dim, ix in zip(prm.shape, index):
        if isinstance(ix, (Span, Gather)):
            out.append(ix.size)
        elif isinstance(ix, Full):
            if dim == "D":
                out.append(s.fixed_head_pad or "HEAD_PAD")
            elif dim == VALUE_DIM:
                out.append("HEAD_PAD_V")
            else:
                out.append(next_pow2(dim) if isinstance(dim, int) else dim)
    return tuple(out)


def _access_problems(st: Load | Store, env: _Env) -> Iterator[str]:
    prm = _params(env.program).get(st.tensor)
    if prm is None:
        yield f"tensor '{st.tensor}' is not a param"
        return
    if prm.role is Role.SCALAR:
        yield f"'{st.tensor}' is a scalar param; use its name in expressions instead"
        return
    if len(st.index) != len(prm.shape):
        yield f"'{st.tensor}' has rank {len(prm.shape)} but is indexed with {len(st.index)} items"
    for ix in st.index:
        if isinstance(ix, Span):
            yield from _size_problems(ix.size)
            yield from _scalar_exprs(env, ix.start)
            if ix.until is not None:
                yield from _integer_expr(env, ix.until, "until")
        elif isinstance(ix, Gather):
            yield from _gather_problems(ix, env)
        elif not isinstance(ix, Full):
            yield from _scalar_exprs(env, ix)


_FLOAT_CALLS = {ExprOp.DIV, ExprOp.EXP, ExprOp.EXP2, ExprOp.LOG, ExprOp.TANH, ExprOp.SIGMOID, ExprOp.SQRT, ExprOp.ERF}
_BOOL_OPS = {ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE, ExprOp.EQ, ExprOp.NE, ExprOp.AND, ExprOp.OR, ExprOp.NOT}
_INT_DTYPES = (Dtype.I32, Dtype.I64)


def _float_part(e: Expr, p: Program) -> str | None:
    """The first sub-expression of `e` that is float-valued (a float constant, `/`, exp.., a float param or load);
    `trunc(...)` is an integer whatever its operand (its operand is not searched)."""
    return _first_float(e, _params(p))


def _first_float(n: Expr, params: dict[str, Param]) -> str | None:
    if n.op is ExprOp.TRUNC:
        return None
    prm = params.get(str(n.value)) if n.op in (ExprOp.VAR, ExprOp.LOAD) else None
    if (n.op is ExprOp.CONST and isinstance(n.value, float) or n.op in _FLOAT_CALLS
            or prm is not None and prm.dtype not in _INT_DTYPES and prm.dtype is not Dtype.BOOL):
        return str(n)
    return next((f for a in n.args if (f := _first_float(a, params)) is not None), None)


def _integer_expr(env: _Env, e: Expr, what: str) -> Iterator[str]:
    bad = list(_scalar_exprs(env, e))
    yield from bad
    if bad or not isinstance(e, Expr):
        return
    if e.op in _BOOL_OPS or e.op is ExprOp.CONST and isinstance(e.value, bool):
        yield f"{what} {e} must be an integer expression, not a condition"
    elif (part := _float_part(e, env.program)) is not None:
        yield f"{what} {e} must be an integer expression; {part} is a float"


def _fill_expr(env: _Env, e: Expr) -> Iterator[str]:
    """An init's fill expression (an attention sink's `sinks[h]`): a scalar number, written as a number when constant."""
    bad = list(_scalar_exprs(env, e))
    yield from bad
    if bad:
        return
    if e.op is ExprOp.CONST:
        yield f"fill {e} is a constant; write the number itself"
    elif e.op in _BOOL_OPS:
        yield f"fill {e} must be a number, not a condition"


def _gather_problems(g: Gather, env: _Env) -> Iterator[str]:
    yield from _size_problems(g.size)
    if _bad_name(g.var):
        yield f"lane variable {g.var!r} is not a valid name (an identifier, not a keyword or inf)"
        return
    if g.var in _reserved(env.program):
        yield f"'{g.var}' shadows a param, dim or schedule constant; pick another lane variable"
        return
    if g.var in env.scalars or g.var in env.tiles:
        yield f"'{g.var}' shadows a name in scope; pick another lane variable"
        return
    lane = env.child()
    lane.scalars.add(g.var)
    yield from _integer_expr(lane, g.index, "gathered index")
    if g.valid is not None:
        yield from _scalar_exprs(lane, g.valid)
        if not isinstance(g.valid, Expr) or not (g.valid.op in _BOOL_OPS or g.valid.op is ExprOp.CONST and isinstance(g.valid.value, bool)):
            yield f"gather condition {g.valid} must be a boolean expression (a comparison, &, | or ~)"


_NOT_NAMES = frozenset(keyword.kwlist) | {"inf", "True", "False", "None"}


def _bad_name(name: object) -> bool:
    return not isinstance(name, str) or not name.isidentifier() or name in _NOT_NAMES


def _define(env: _Env, name: str, shape: Shape | None, *, scalar: bool = False) -> Iterator[str]:
    """Bind `name` as a scalar, or as a tile of `shape` (None: unknown after an earlier problem)."""
    if _bad_name(name):
        yield f"{name!r} is not a valid name (an identifier, not a keyword or inf)"
        return
    if name in _reserved(env.program):
        yield f"'{name}' shadows a param, dim or schedule constant; pick another name"
        return
    if scalar:
        if name in env.tiles:
            yield f"'{name}' is already a tile; scalars and tiles share one namespace"
            return
        env.scalars.add(name)
    else:
        if name in env.scalars:
            yield f"'{name}' is already a scalar; scalars and tiles share one namespace"
            return
        env.tiles[name] = shape


def _known(env: _Env, *names: str) -> list[Shape] | None:
    """Shapes of defined tiles, or None when any is undefined or of unknown shape."""
    shapes = [sh for sh in (env.tiles.get(n) for n in names) if sh is not None]
    return shapes if len(shapes) == len(names) else None


def _agree(a: Shape, b: Shape, s: Schedule) -> bool:
    return len(a) == len(b) and all(_same(x, y, s) for x, y in zip(a, b))


# ================================================================ statement rules


def _vars(e: object) -> set[str]:
    return {str(n.value) for n in walk(e) if isinstance(n, Expr) and n.op is ExprOp.VAR} if isinstance(e, Expr) else set()


def _scores_2d(env: _Env, name: str) -> Iterator[str]:
    yield from _need_tiles(env, tile=name)
    shape = env.tiles.get(name)
    if shape is not None and len(shape) != 2:
        yield f"'{name}' must be a 2-D score tile, got {_shape_str(shape)}"


def _row_stat(env: _Env, tile: str, rows: str) -> Iterator[str]:
    """`rows` must be the [R] row vector of the 2-D tile `tile` [R, C]."""
    known = _known(env, tile, rows)
    if known is not None and len(known[0]) == 2 and not _agree(known[1], known[0][:1], env.program.schedule):
        yield f"shape mismatch: '{rows}' {_shape_str(known[1])} is not a row vector of '{tile}' {_shape_str(known[0])}"


def _grad_of_scores(st: ScoreModGrad | AuxGrad, env: _Env) -> Iterator[str]:
    yield from _scores_2d(env, st.tile)
    yield from _scores_2d(env, st.scores)
    known = _known(env, st.tile, st.scores)
    if known is not None and not _agree(known[0], known[1], env.program.schedule):
        yield f"shape mismatch: '{st.tile}' {_shape_str(known[0])} and '{st.scores}' {_shape_str(known[1])}"
    yield from _tile_at(env, st.at)


class StmtRules(StmtVisitor[Iterator["str | Problem"]]):
    """The per-statement rules: each yields messages about its statement (nested bodies yield located Problems)."""

    def s_let(self, st: Let, env: _Env) -> Iterator[str]:
        yield from _scalar_exprs(env, st.value)
        yield from _define(env, st.name, None, scalar=True)

    def s_load(self, st: Load, env: _Env) -> Iterator[str]:
        bad = list(_access_problems(st, env))
        yield from bad
        if isinstance(st.other, bool) or not isinstance(st.other, (int, float)) or math.isnan(st.other):
            yield f"other={st.other!r} must be a number"
        prm = _params(env.program).get(st.tensor)
        shape = _index_shape(prm, st.index, env.program.schedule) if prm and not bad else None
        yield from _define(env, st.out, shape)

    def s_store(self, st: Store, env: _Env) -> Iterator[str]:
        bad = list(_access_problems(st, env))
        yield from bad
        prm = _params(env.program).get(st.tensor)
        if prm is not None and prm.role not in (Role.OUT, Role.SCRATCH):
            yield f"'{st.tensor}' is an {prm.role.value} param; only out and scratch params are stored"
        if st.accumulate and prm is not None and prm.dtype is not Dtype.F32:
            yield f"'{st.tensor}' is {prm.dtype.value}; an accumulating store (+=) needs an f32 tensor"
        yield from _need_tiles(env, value=st.value)
        shape = env.tiles.get(st.value)
        if bad or prm is None or shape is None:
            return
        target = _index_shape(prm, st.index, env.program.schedule)
        if len(shape) != len(target):
            yield f"tile '{st.value}' has rank {len(shape)} but the store target {_shape_str(target)} has rank {len(target)}"
        elif not _agree(shape, target, env.program.schedule):
            yield f"shape mismatch: tile '{st.value}' is {_shape_str(shape)}, store target is {_shape_str(target)}"

    def s_init(self, st: Init, env: _Env) -> Iterator[str]:
        allowed = set(SCHEDULE_CONSTANTS) | set(env.program.dims())
        for d in st.shape:
            if not (isinstance(d, str) and d in allowed or isinstance(d, int) and not isinstance(d, bool) and d > 0):
                yield f"init dim {d!r} must be a schedule constant, a dim or a positive int"
        if not isinstance(st.dtype, Dtype):
            yield f"unknown dtype {st.dtype!r}"
        if isinstance(st.fill, Expr):
            yield from _fill_expr(env, st.fill)
        elif isinstance(st.fill, bool) or not isinstance(st.fill, (int, float)) or math.isnan(st.fill):
            yield f"fill {st.fill!r} must be a number or a scalar expression"
        yield from _define(env, st.out, tuple(st.shape))

    def s_dot(self, st: Dot, env: _Env) -> Iterator[str]:
        yield from _need_tiles(env, a=st.a, b=st.b)
        out: Shape | None = None
        if (known := _known(env, st.a, st.b)) is not None:
            a, b = known
            if len(a) != 2 or len(b) != 2:
                yield f"dot needs 2-D tiles, got '{st.a}' {_shape_str(a)} and '{st.b}' {_shape_str(b)}"
            else:
                outer_a, inner_a = (a[1], a[0]) if st.trans_a else (a[0], a[1])
                inner_b, outer_b = (b[1], b[0]) if st.trans_b else (b[0], b[1])
                if not _same(inner_a, inner_b, env.program.schedule):
                    yield (f"shape mismatch: inner dims of {'trans(' + st.a + ')' if st.trans_a else repr(st.a)} {_shape_str(a)} and "
                           f"{'trans(' + st.b + ')' if st.trans_b else repr(st.b)} {_shape_str(b)} disagree")
                out = (outer_a, outer_b)
        yield from _define(env, st.out, out)

    def s_elementwise(self, st: Elementwise, env: _Env) -> Iterator[str]:
        yield from _expr_problems(st.value, env.scalars, env.tiles, env.program, allow_tiles=True)
        names = [n for n in sorted(_vars(st.value)) if n in env.tiles]
        known = _known(env, *names)
        out: Shape | None = None if known is None else ()
        for shape in known or ():
            if out and not _agree(out, shape, env.program.schedule):
                listed = ", ".join(f"{n} {_shape_str(sh)}" for n, sh in zip(names, known or ()))
                yield f"shape mismatch: elementwise operands have shapes {listed}"
                break
            out = out or shape
        yield from _define(env, st.out, out)

    def s_reduce(self, st: Reduce, env: _Env) -> Iterator[str]:
        if st.kind not in ("max", "sum"):
            yield f"reduce kind {st.kind!r} must be max or sum"
        yield from _need_tiles(env, src=st.src)
        out: Shape | None = None
        if (known := _known(env, st.src)) is not None:
            (src,) = known
            if isinstance(st.axis, bool) or not isinstance(st.axis, int) or not 0 <= st.axis < len(src):
                yield f"axis {st.axis!r} out of range for '{st.src}' {_shape_str(src)}"
            else:
                out = src[:st.axis] + src[st.axis + 1:]
        yield from _define(env, st.out, out)

    def s_scoremod(self, st: ScoreMod, env: _Env) -> Iterator[str]:
        if env.program.score_mod is None:
            yield "score_mod statement in a program without a score_mod function"
        yield from _scores_2d(env, st.tile)
        yield from _tile_at(env, st.at, head_rows_ok=True)

    def s_mask(self, st: Mask, env: _Env) -> Iterator[str]:
        if st.use_mask_mod and env.program.mask_mod is None:
            yield "mask ... mask_mod in a program without a mask_mod function (use 'bounds')"
        yield from _scores_2d(env, st.tile)
        yield from _tile_at(env, st.at, head_rows_ok=True)

    def s_onlinesoftmax(self, st: OnlineSoftmax, env: _Env) -> Iterator[str]:
        yield from _need_tiles(env, m=st.m, l=st.l, acc=st.acc, scores=st.scores, values=st.values)
        known = _known(env, st.scores, st.values, st.m, st.l, st.acc)
        if known is None:
            return
        s, v = known[:2]
        if len(s) != 2 or len(v) != 2:
            yield f"online_softmax needs 2-D scores and values, got {_shape_str(s)} and {_shape_str(v)}"
            return
        sched = env.program.schedule
        if not _same(s[1], v[0], sched):
            yield f"shape mismatch: scores '{st.scores}' {_shape_str(s)} and values '{st.values}' {_shape_str(v)} disagree on the kv dim"
        want = {st.m: (s[0],), st.l: (s[0],), st.acc: (s[0], v[1])}
        for (name, shape), got in zip(want.items(), known[2:]):
            if not _agree(got, shape, sched):
                yield f"shape mismatch: '{name}' is {_shape_str(got)}, the softmax state needs {_shape_str(shape)}"

    def s_finalize(self, st: Finalize, env: _Env) -> Iterator[str]:
        yield from _need_tiles(env, m=st.m, l=st.l, acc=st.acc)
        o_shape: Shape | None = None
        lse_shape: Shape | None = None
        if (known := _known(env, st.m, st.acc)) is not None:
            m, acc = known
            if len(m) != 1 or len(acc) != 2 or not _same(m[0], acc[0], env.program.schedule):
                yield f"shape mismatch: finalize needs m [R] and acc [R, D], got {_shape_str(m)} and {_shape_str(acc)}"
            else:
                o_shape, lse_shape = acc, m
        yield from _define(env, st.o, o_shape)
        yield from _define(env, st.lse, lse_shape)

    def s_combine(self, st: Combine, env: _Env) -> Iterator[str]:
        yield from _need_tiles(env, o_parts=st.o_parts, lse_parts=st.lse_parts)
        o_shape: Shape | None = None
        lse_shape: Shape | None = None
        if (known := _known(env, st.o_parts, st.lse_parts)) is not None:
            op, lp = known
            if len(op) != 3 or len(lp) != 2 or not _agree(op[:2], lp, env.program.schedule):
                yield f"shape mismatch: combine needs o_parts [S, R, D] and lse_parts [S, R], got {_shape_str(op)} and {_shape_str(lp)}"
            else:
                o_shape, lse_shape = op[1:], lp[1:]
        yield from _define(env, st.o, o_shape)
        yield from _define(env, st.lse, lse_shape)

    def s_for(self, st: For, env: _Env) -> Iterator[str | Problem]:
        yield from _scalar_exprs(env, st.lo, st.hi)
        if isinstance(st.step, bool) or not (st.step in ("BLOCK_N", "BLOCK_M") or isinstance(st.step, int) and st.step > 0):
            yield f"loop step {st.step!r} must be a block size (BLOCK_N, BLOCK_M) or a positive int"
        if st.order not in ("forward", "reverse"):
            yield f"loop order {st.order!r} must be forward or reverse"
        if not st.body:
            yield "empty loop body"
        inner = env.child()
        yield from _define(inner, st.var, None, scalar=True)
        yield from _walk_block(st.body, inner)

    def s_ifblock(self, st: IfBlock, env: _Env) -> Iterator[str | Problem]:
        if not isinstance(st.cls, BlockClass):
            yield f"unknown block class {st.cls!r}; known: full, partial, empty"
        yield from _tile_at(env, st.at)
        if not st.then:
            yield "empty 'if' body"
        then, orelse = env.child(), env.child()
        yield from _walk_block(st.then, then)
        yield from _walk_block(st.orelse, orelse)
        if st.orelse:
            for name in then.tiles.keys() & orelse.tiles.keys() - env.tiles.keys():
                env.tiles[name] = then.tiles[name]
            env.scalars |= (then.scalars & orelse.scalars) - env.scalars

    def s_probs(self, st: Probs, env: _Env) -> Iterator[str]:
        yield from _scores_2d(env, st.scores)
        yield from _need_tiles(env, lse=st.lse)
        yield from _row_stat(env, st.scores, st.lse)
        yield from _define(env, st.out, env.tiles.get(st.scores))

    def s_softmaxgrad(self, st: SoftmaxGrad, env: _Env) -> Iterator[str]:
        yield from _scores_2d(env, st.p)
        yield from _need_tiles(env, dp=st.dp, delta=st.delta)
        known = _known(env, st.p, st.dp)
        if known is not None and not _agree(known[0], known[1], env.program.schedule):
            yield f"shape mismatch: '{st.p}' {_shape_str(known[0])} and '{st.dp}' {_shape_str(known[1])}"
        yield from _row_stat(env, st.p, st.delta)
        yield from _define(env, st.out, env.tiles.get(st.p))

    def s_scoremodgrad(self, st: ScoreModGrad, env: _Env) -> Iterator[str]:
        yield from _grad_of_scores(st, env)

    def s_auxgrad(self, st: AuxGrad, env: _Env) -> Iterator[str]:
        yield from _grad_of_scores(st, env)
        if st.lse is not None:
            yield from _need_tiles(env, lse=st.lse)
            yield from _row_stat(env, st.scores, st.lse)
        prms = _params(env.program)
        aux, grad = prms.get(st.aux), prms.get(st.grad)
        fn = env.program.score_mod
        if aux is None or aux.role is not Role.AUX:
            yield f"'{st.aux}' must be an aux param"
        elif fn is None or st.aux not in {str(n.value) for n in walk(fn.body) if n.op is ExprOp.LOAD}:
            yield f"score_mod does not read '{st.aux}', so it has no gradient here"
        if grad is None or grad.role is not Role.OUT or grad.dtype is not Dtype.F32:
            yield f"'{st.grad}' must be an f32 out param"
        elif aux is not None and grad.shape != aux.shape:
            yield f"'{st.grad}' {list(grad.shape)} must have the shape of '{st.aux}' {list(aux.shape)}"


_RULES = StmtRules()


def _header(st: Stmt) -> str:
    try:
        return print_stmt_header(st)
    except Exception:
        return f"{st.op.value} ..."


def _walk_block(stmts: tuple[Stmt, ...], env: _Env) -> Iterator[Problem]:
    for st in stmts:
        env.counter[0] += 1
        try:
            stmt_op(st)
        except KBError as err:
            yield Problem(f"kernel {env.kernel}, statement {env.counter[0]} ({st!r})", str(err))
            continue
        where = f"kernel {env.kernel}, statement {env.counter[0]} ({_header(st)})"
        for msg in _RULES.visit(st, env):
            yield msg if isinstance(msg, Problem) else Problem(where, msg)


# ================================================================ program rules


def _param_rules(p: Program) -> Iterator[Problem]:
    seen: set[str] = set()
    for prm in p.params:
        where = f"param {getattr(prm, 'name', prm)!r}"
        if not isinstance(prm, Param):
            yield Problem(where, "not a Param")
            continue
        if _bad_name(prm.name):
            yield Problem(where, "name is not an identifier")
        if prm.name in seen:
            yield Problem(where, "defined twice")
        seen.add(prm.name)
        if not isinstance(prm.dtype, Dtype) or not isinstance(prm.role, Role):
            yield Problem(where, f"unknown dtype or role ({prm.dtype!r}, {prm.role!r})")
        if prm.role is Role.SCALAR and prm.shape:
            yield Problem(where, "a scalar param has shape []")
        for d in prm.shape:
            if not (isinstance(d, str) and d.isidentifier() or isinstance(d, int) and not isinstance(d, bool) and d > 0):
                yield Problem(where, f"dim {d!r} must be a name or a positive int")
    if "q" in seen and _params(p)["q"].role is not Role.IN:
        yield Problem("param 'q'", "q must be an in param")
    for name in ("q", "k"):
        qk = _params(p).get(name)
        if isinstance(qk, Param) and qk.shape and qk.shape[-1] == VALUE_DIM:
            yield Problem(f"param '{name}'", f"{name} ends in the query/key head dim D; only values and outputs take {VALUE_DIM}")


def _schedule_rules(p: Program) -> Iterator[Problem]:
    s = p.schedule
    if not isinstance(s, Schedule):
        yield Problem("schedule", f"not a Schedule: {s!r}")
        return
    for key in ("block_m", "block_n", "num_warps", "num_stages", "num_splits"):
        value = getattr(s, key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            yield Problem("schedule", f"{key}={value!r} must be a positive int")
    for key in ("block_m", "block_n", "num_warps"):
        value = getattr(s, key)
        if isinstance(value, int) and value > 0 and not is_pow2(value):
            yield Problem("schedule", f"{key}={value} must be a power of two")
    if not isinstance(s.head_pad, int) or s.head_pad < 0 or (s.head_pad and not is_pow2(s.head_pad)):
        yield Problem("schedule", f"head_pad={s.head_pad!r} must be 0 (auto) or a power of two")
    if s.kv_order not in ("forward", "reverse"):
        yield Problem("schedule", f"kv_order={s.kv_order!r} must be forward or reverse")
    if not isinstance(s.warp_specialize, bool):
        yield Problem("schedule", f"warp_specialize={s.warp_specialize!r} must be True or False")


def _variant_rules(p: Program) -> Iterator[Problem]:
    scalars = {prm.name for prm in p.params if prm.role is Role.SCALAR}
    for slot, expected in (("score_mod", SCORE_MOD_PARAMS), ("mask_mod", MASK_MOD_PARAMS)):
        fn = getattr(p, slot)
        if fn is None:
            continue
        if not isinstance(fn, VariantFn):
            yield Problem(slot, f"not a VariantFn: {fn!r}")
            continue
        if fn.kind != slot:
            yield Problem(slot, f"holds a {fn.kind!r} function")
        if len(fn.params) != len(expected) or len(set(fn.params)) != len(fn.params):
            yield Problem(slot, f"takes {len(expected)} distinct parameters ({', '.join(expected)}), got {fn.params}")
        scope = set(fn.params) | set(p.dims()) | scalars
        for msg in _expr_problems(fn.body, scope, {}, p, allow_tiles=False, aux_only=True):
            yield Problem(slot, msg)


def _name_rules(p: Program) -> Iterator[Problem]:
    """Names the text form prints bare must read back as NAME tokens."""
    if _bad_name(p.name):
        yield Problem(f"program {p.name!r}", "name must be an identifier (letters, digits, _)")
    for k in p.kernels:
        if isinstance(k, Kernel) and _bad_name(k.name):
            yield Problem(f"kernel {k.name!r}", "name must be an identifier (letters, digits, _)")
    for fn in (p.score_mod, p.mask_mod):
        if isinstance(fn, VariantFn) and any(_bad_name(n) for n in fn.params):
            yield Problem(fn.kind, f"parameter names {fn.params} must be identifiers")


def _kernel_rules(p: Program) -> Iterator[Problem]:
    if not p.kernels:
        yield Problem(f"program {p.name}", "has no kernel")
    names: set[str] = set()
    for k in p.kernels:
        if not isinstance(k, Kernel):
            yield Problem(f"program {p.name}", f"not a Kernel: {k!r}")
            continue
        if k.name in names:
            yield Problem(f"kernel {k.name}", "defined twice")
        names.add(k.name)
        env = _Env(p, k.name, _base_scalars(p), {})
        if not k.grid:
            yield Problem(f"kernel {k.name}", "grid has no axis")
        for axis in k.grid:
            for msg in _expr_problems(axis.extent, _base_scalars(p), {}, p, allow_tiles=False):
                yield Problem(f"kernel {k.name}, grid axis {axis.name}", msg)
            for msg in _define(env, axis.name, None, scalar=True):
                yield Problem(f"kernel {k.name}, grid axis {axis.name}", msg)
        if not k.body:
            yield Problem(f"kernel {k.name}", "empty body")
        yield from _walk_block(k.body, env)


def _stores(stmts: tuple[Stmt, ...]) -> Iterator[Store | AuxGrad]:
    for st in stmts:
        if isinstance(st, Store | AuxGrad):
            yield st
        elif isinstance(st, For):
            yield from _stores(st.body)
        elif isinstance(st, IfBlock):
            yield from _stores(st.then + st.orelse)


def _outputs_stored(p: Program) -> Iterator[Problem]:
    stored = {st.grad if isinstance(st, AuxGrad) else st.tensor
              for k in p.kernels if isinstance(k, Kernel) for st in _stores(k.body)}
    for prm in p.params:
        if isinstance(prm, Param) and prm.role is Role.OUT and prm.name not in stored:
            yield Problem(f"param '{prm.name}'", "out param is never stored")


PROGRAM_RULES: tuple[Callable[[Program], Iterator[Problem]], ...] = (
    _name_rules, _param_rules, _schedule_rules, _variant_rules, _kernel_rules, _outputs_stored,
)


def problems(p: Program) -> tuple[Problem, ...]:
    """Every rule violation of `p`, in rule order (empty when `p` is well-formed)."""
    if not isinstance(p, Program):
        return (Problem("program", f"not a Program: {type(p).__name__}"),)
    return tuple(prob for rule in PROGRAM_RULES for prob in rule(p))


def validate(p: Program) -> None:
    """Raise `KBError` naming every bad node; return None for a well-formed program."""
    found = problems(p)
    if found:
        head = f"program {getattr(p, 'name', '?')} is not valid IR ({len(found)} problem{'s' * (len(found) > 1)}):"
        raise KBError("\n".join([head, *(f"  {prob}" for prob in found)]))
