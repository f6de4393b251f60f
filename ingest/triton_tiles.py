"""Tile dataflow walk of one specialized Triton kernel (used to recognise backward kernels).

The forward walker (`ingest.triton_exec`) tags tiles with the idioms they came from; a backward
kernel needs more: which tile is multiplied with which, along which axis, and what is added to
which accumulator across loop iterations. This walker keeps every tile value as a node of a
dataflow graph (`TV`), and every index as an IR expression over source names:
- `tl.arange(0, X)` is a lane variable `_l_X` (one per extent); `x[:, None]` / `x[None, :]` tag its
  lanes with the axis they span (`_l_X@0`, `_l_X@1`), so a loaded tile knows its axes;
- a tile's `lanes` are its axes (rows, cols), `None` for a broadcast axis; a `tl.dot` checks that it
  contracts matching lanes (old `trans_a=`/`trans_b=` keywords, `tl.trans`, `.T` flip the axes);
- loops may nest and step by anything; a value assigned in a loop body and live before it is a
  loop-carried `carry` node (its update is recorded per loop), and a pointer or scalar advanced by
  `x += d` at the top of the body is an induction variable (`x0 + (i - lo) / step * d`);
- `tl.store` / `tl.atomic_add` become `Effect`s in the scope (kernel or loop) they run in; an `if` on a
  runtime scalar that ends in `return` is an `EarlyExit` (its effects kept apart for the lifter to judge).
Kernel parameters reached additively from a load/store pointer are pointers; all others are
scalars (a VAR of their own name). Nothing is guessed: what cannot be followed is listed in
`unknown` with its line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from kb.ir.expr import Expr, ExprOp, call, const, free_vars, load, substitute, var, walk
from ingest.triton_exec import Opaque, Ptr, as_bool, is_bool, bool_chain
from ingest.triton_source import JitFn, TritonModule, Unknown, const_eval, node_file
from kb.ir.algebra import from_poly, normal_form, to_poly

__all__ = ["TV", "Ptr", "Effect", "LoopNode", "EarlyExit", "TileWalk", "walk_tiles", "strip_tags", "lanes_of",
           "AXIS_TAG", "NO_OPS"]

AXIS_TAG = "@"  # `_l_BLOCK_M@0`: lane of tl.arange(0, BLOCK_M) spanning axis 0 of a 2-D tile
NO_OPS = {"debug_barrier", "static_assert", "static_print", "device_print", "device_assert", "print",
          "max_contiguous", "assume"}
_UNARY_TILE = {"exp", "exp2", "log", "log2", "abs", "sqrt"}


@dataclass(frozen=True, eq=False)
class TV:
    """A tile value: `op` over `args` (TVs or scalar Exprs), with its axes' lanes and source line.

    ops: load (info: Ptr, other), zeros, dot (info: (trans_a, trans_b)), add, sub, mul, div, neg,
    exp, exp2, log, log2, abs, sqrt, where (info: condition Expr or a TV), sum / max (info: axis),
    trans, carry (info: source name; args: (initial value,)), loop_out (info: LoopNode; args:
    (carry, final)), select (info: runtime condition; args: (then, else)), maximum, minimum."""

    op: str
    args: tuple
    lanes: tuple
    line: int
    info: object = None

    def load_ptr(self) -> Ptr:
        """The pointer a `load` reads."""
        assert self.op == "load" and isinstance(self.info, tuple) and isinstance(self.info[0], Ptr)
        return self.info[0]


@dataclass
class Effect:
    kind: str  # "store" | "atomic_add"
    ptr: Ptr
    value: "TV | Expr"
    mask: Expr | None
    line: int
    file: str
    cond: Expr | None = None  # a runtime condition the effect sits under


@dataclass
class LoopNode:
    var: str
    lo: Expr
    hi: Expr
    step: Expr
    line: int
    end_line: int
    file: str
    body: list = field(default_factory=list)  # Effect | LoopNode | EarlyExit, in order
    carried: dict = field(default_factory=dict)  # name -> (carry TV, final TV)


@dataclass
class EarlyExit:
    cond: Expr
    effects: list
    line: int
    end_line: int


@dataclass
class TileWalk:
    body: list = field(default_factory=list)  # kernel scope: Effect | LoopNode | EarlyExit
    pointers: set = field(default_factory=set)  # kernel params used as pointers
    scalars: set = field(default_factory=set)  # the other kernel params
    lanes: dict = field(default_factory=dict)  # lane var -> extent Expr (source names)
    compares: list = field(default_factory=list)  # every comparison seen (load/store masks, wheres, ifs)
    unknown: list = field(default_factory=list)  # (line, what)
    casts: list = field(default_factory=list)  # lines of `.to(...)` casts of tiles


Sym = Expr | Ptr | TV | Opaque


def strip_tags(e: Expr) -> Expr:
    """`_l_X@0` -> `_l_X`: the lane without its axis tag."""
    names = {n for n in free_vars(e) if AXIS_TAG in n}
    return substitute(e, {n: var(n.split(AXIS_TAG)[0]) for n in names}) if names else e


def lanes_of(e: Expr) -> set[str]:
    """The (untagged) lanes an expression mentions."""
    return {n.split(AXIS_TAG)[0] for n in free_vars(e) if n.startswith("_l_")}


def _tagged(e: Expr, axis: int) -> Expr:
    names = {n for n in free_vars(e) if n.startswith("_l_")}
    return substitute(e, {n: var(f"{n.split(AXIS_TAG)[0]}{AXIS_TAG}{axis}") for n in names})


def _axes(e: Expr) -> tuple:
    """The lanes of a pointer offset by axis: (rows, cols) when tagged, (lane,) for a 1-D vector."""
    names = {n for n in free_vars(e) if n.startswith("_l_")}
    tagged = {n for n in names if AXIS_TAG in n}
    if not tagged:
        return tuple(sorted(names))
    rows = sorted({n.split(AXIS_TAG)[0] for n in tagged if n.endswith("@0")})
    cols = sorted({n.split(AXIS_TAG)[0] for n in tagged if n.endswith("@1")})
    return (rows[0] if len(rows) == 1 else None, cols[0] if len(cols) == 1 else None)


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    """Lanes of an elementwise result (numpy broadcasting; None = a broadcast axis); None on a clash."""
    rank = max(len(a), len(b))
    if rank < 2:  # row vectors (or a vector and a scalar) stay 1-D
        return a or b if not (a and b) or a == b else None
    a, b = (None,) * (2 - len(a)) + tuple(a), (None,) * (2 - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x is not None and y is not None and x != y:
            return None
        out.append(x if x is not None else y)
    return tuple(out)


_BIN = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.FloorDiv: "floordiv", ast.Mod: "mod",
        ast.BitAnd: "and", ast.BitOr: "or"}
_EXPR_BIN = {"add": ExprOp.ADD, "sub": ExprOp.SUB, "mul": ExprOp.MUL, "div": ExprOp.DIV, "floordiv": ExprOp.FLOORDIV,
             "mod": ExprOp.MOD, "and": ExprOp.AND, "or": ExprOp.OR}
_CMP = {ast.Lt: ExprOp.LT, ast.LtE: ExprOp.LE, ast.Gt: ExprOp.GT, ast.GtE: ExprOp.GE, ast.Eq: ExprOp.EQ,
        ast.NotEq: ExprOp.NE}
_PURE = {"cdiv": "cdiv", "minimum": "minimum", "maximum": "maximum", "min": "minimum", "max": "maximum", "abs": "abs"}


def pointer_params(fn: ast.FunctionDef, body: list[ast.stmt]) -> set[str]:
    """Kernel parameters reached through `+`/`-` (and plain copies) from the pointer argument of a
    load, store or atomic: `Q + offs * stride` makes Q a pointer, never the stride."""
    params = {a.arg for a in fn.args.args}
    assigns: dict[str, list[ast.AST]] = {}
    for n in (x for st in body for x in ast.walk(st)):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            assigns.setdefault(n.targets[0].id, []).append(n.value)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            assigns.setdefault(n.target.id, []).append(n.value)
    roots: list[ast.AST] = []
    for n in (x for st in body for x in ast.walk(st)):
        if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] in ("load", "store", "atomic_add") and n.args:
            roots.append(n.args[0])
    seen: set[str] = set()
    while roots:
        for name in _additive_names(roots.pop()):
            if name not in seen:
                seen.add(name)
                roots.extend(assigns.get(name, []))
    return seen & params


def _additive_names(n: ast.AST) -> set[str]:
    if isinstance(n, ast.Name):
        return {n.id}
    if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)):
        return _additive_names(n.left) | _additive_names(n.right)
    if isinstance(n, ast.Subscript):
        return _additive_names(n.value)
    if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "multiple_of" and n.args:
        return _additive_names(n.args[0])
    return set()


class _TileWalker:
    def __init__(self, mod: TritonModule, fn: JitFn, body: list[ast.stmt], consts: dict[str, object]) -> None:
        self.mod, self.consts = mod, consts
        self.out = TileWalk()
        self.out.pointers = pointer_params(fn.node, body)
        self.env: dict[str, Sym] = {}
        self.scope: list = self.out.body
        self.cond: Expr | None = None
        self.used: set[str] = set()
        for a in fn.node.args.args:
            if a.arg in consts and isinstance(consts[a.arg], (bool, int, float)):
                self.env[a.arg] = const(consts[a.arg])  # type: ignore[arg-type]
            elif a.arg in self.out.pointers:
                self.env[a.arg] = Ptr(a.arg, const(0))
            elif a.arg not in consts:
                self.env[a.arg] = var(a.arg)
                self.out.scalars.add(a.arg)

    # ---------------------------------------------------------------- helpers
    def _unknown(self, n: ast.AST, what: str) -> Opaque:
        self.out.unknown.append((getattr(n, "lineno", 0), what))
        return Opaque(what)

    def _file(self, n: ast.AST) -> str:
        return node_file(n, self.mod.file)

    def _lane(self, extent: Expr) -> str:
        text = str(extent)
        name = "_l_" + "".join(c if c.isalnum() or c == "_" else "_" for c in text)
        self.out.lanes.setdefault(name, extent)
        return name

    def _fresh(self, name: str) -> str:
        cand, i = name, 1
        while cand in self.used or cand in self.env and not isinstance(self.env[cand], Expr):
            cand, i = f"{name}_{i}", i + 1
        self.used.add(cand)
        return cand

    def _compare(self, e: Expr) -> None:
        for c in walk(e):
            if c.op in (ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE):
                self.out.compares.append(c)

    # ---------------------------------------------------------------- expressions
    def ev(self, n: ast.AST) -> Sym:
        if isinstance(n, ast.Constant):
            return const(n.value) if isinstance(n.value, (bool, int, float)) else Opaque(repr(n.value))
        if isinstance(n, ast.Name):
            return self._name(n.id)
        if isinstance(n, ast.Subscript):
            return self._subscript(n)
        if isinstance(n, ast.UnaryOp):
            return self._unary(n)
        if isinstance(n, ast.BoolOp):
            vals = [self.ev(v) for v in n.values]
            if all(isinstance(v, Expr) for v in vals):
                return bool_chain(n.op, vals)  # type: ignore[arg-type]
            return self._unknown(n, f"boolean operator on tiles: {ast.unparse(n)}")
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in _CMP:
            a, b = self.ev(n.left), self.ev(n.comparators[0])
            if isinstance(a, Expr) and isinstance(b, Expr):
                return Expr(_CMP[type(n.ops[0])], (a, b))
            return self._unknown(n, f"comparison of tiles: {ast.unparse(n)}")
        if isinstance(n, ast.IfExp):
            try:
                return self.ev(n.body if const_eval(n.test, self.consts) else n.orelse)
            except Unknown:
                t = self.ev(n.test)
                if isinstance(t, Expr) and t.op is ExprOp.CONST:
                    return self.ev(n.body if t.value else n.orelse)
                a, b = self.ev(n.body), self.ev(n.orelse)
                if all(isinstance(x, Expr) for x in (t, a, b)):
                    return call("where", as_bool(t), a, b)  # type: ignore[arg-type]
                return self._unknown(n, f"conditional expression {ast.unparse(n)}")
        if isinstance(n, ast.BinOp):
            return self._binop(n)
        if isinstance(n, ast.Call):
            return self._call(n)
        if isinstance(n, ast.Attribute) and n.attr == "T":
            return self._trans(n, self.ev(n.value))
        if isinstance(n, ast.Attribute):
            return Opaque(ast.unparse(n))
        return self._unknown(n, f"unsupported syntax {type(n).__name__}")

    def _name(self, name: str) -> Sym:
        if name in self.env:
            return self.env[name]
        value = self.consts.get(name, self.mod.module_values.get(name))
        if isinstance(value, (bool, int, float)):
            return const(value)
        return Opaque(name)

    def _subscript(self, n: ast.Subscript) -> Sym:
        v = self.ev(n.value)
        sl = n.slice
        items = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        if len(items) == 2:
            none = [isinstance(i, ast.Constant) and i.value is None for i in items]
            if none == [False, True]:
                axis = 0
            elif none == [True, False]:
                axis = 1
            else:
                return self._unknown(n, f"subscript {ast.unparse(n)}")
            if isinstance(v, Expr):
                return _tagged(v, axis)
            if isinstance(v, TV) and len(v.lanes) == 1:
                return TV(v.op, v.args, (v.lanes[0], None) if axis == 0 else (None, v.lanes[0]), v.line, v.info)
        if isinstance(v, (Expr, TV)) and len(items) == 1 and isinstance(items[0], ast.Slice):
            return v
        return self._unknown(n, f"subscript {ast.unparse(n)}")

    def _unary(self, n: ast.UnaryOp) -> Sym:
        v = self.ev(n.operand)
        if isinstance(v, Expr):
            if isinstance(n.op, ast.USub):
                return -v  # a numeric constant folds
            if isinstance(n.op, (ast.Not, ast.Invert)):
                if v.op is ExprOp.CONST and isinstance(v.value, bool):
                    return const(not v.value)  # a flag bound through an inlined helper's parameter
                return ~as_bool(v)
        if isinstance(v, TV) and isinstance(n.op, ast.USub):
            return TV("neg", (v,), v.lanes, n.lineno)
        return self._unknown(n, f"unary {ast.unparse(n)}")

    def _binop(self, n: ast.BinOp) -> Sym:
        op = _BIN.get(type(n.op))
        a, b = self.ev(n.left), self.ev(n.right)
        if op is None:
            return self._unknown(n, f"operator {type(n.op).__name__}")
        if isinstance(a, Ptr) and isinstance(b, Expr) and op in ("add", "sub"):
            return Ptr(a.base, Expr(_EXPR_BIN[op], (a.offset, b)))
        if isinstance(b, Ptr) and isinstance(a, Expr) and op == "add":
            return Ptr(b.base, b.offset + a)
        if isinstance(a, Expr) and isinstance(b, Expr):
            if op in ("floordiv", "mod") and b == const(1):
                return a if op == "floordiv" else const(0)
            if op in ("and", "or") and (is_bool(a) or is_bool(b)):
                return Expr(_EXPR_BIN[op], (as_bool(a), as_bool(b)))
            return Expr(_EXPR_BIN[op], (a, b))
        if (isinstance(a, TV) or isinstance(b, TV)) and all(isinstance(x, (TV, Expr)) for x in (a, b)) \
                and op in ("add", "sub", "mul", "div"):
            lanes = _broadcast(_tile_lanes(a), _tile_lanes(b))
            if lanes is None:
                return self._unknown(n, f"elementwise {op} of tiles over different lanes "
                                        f"{_tile_lanes(a)} and {_tile_lanes(b)}")
            return TV(op, (a, b), lanes, n.lineno)
        return self._unknown(n, f"operator {op} on {type(a).__name__} and {type(b).__name__}: {ast.unparse(n)}")

    def _trans(self, n: ast.AST, v: Sym) -> Sym:
        if isinstance(v, TV) and len(v.lanes) == 2:
            return TV("trans", (v,), (v.lanes[1], v.lanes[0]), getattr(n, "lineno", 0))
        return self._unknown(n, f"transpose of {type(v).__name__}")

    def _call(self, n: ast.Call) -> Sym:
        name = ast.unparse(n.func).split(".")[-1]
        kw = {k.arg: k.value for k in n.keywords if k.arg}
        if isinstance(n.func, ast.Attribute) and name == "to":
            v = self.ev(n.func.value)
            if isinstance(v, TV):
                self.out.casts.append(n.lineno)
            return v
        if name in NO_OPS:
            return Opaque(name)
        if name == "program_id":
            axis = const_eval(n.args[0] if n.args else kw["axis"], {})
            return var(f"pid{axis}")
        if name == "arange":
            return var(self._lane(normal_form(self._expr(n.args[1], n))))
        if name == "float" and n.args:
            try:
                return const(float(const_eval(n.args[0], {})))  # type: ignore[arg-type]
            except (Unknown, ValueError):
                return self._unknown(n, f"{ast.unparse(n)}")
        if name in ("multiple_of",) and n.args:
            return self.ev(n.args[0])
        if name == "trans" and n.args:
            return self._trans(n, self.ev(n.args[0]))
        if name in ("zeros", "full"):
            return self._zeros(n, kw)
        if name == "load":
            return self._load(n, kw)
        if name in ("store", "atomic_add"):
            return self._store(n, name, kw)
        if name == "dot":
            return self._dot(n, kw)
        if name == "where":
            return self._where(n)
        if name in _UNARY_TILE and n.args and isinstance(x := self.ev(n.args[0]), TV):
            return TV(name, (x,), x.lanes, n.lineno)
        if name in ("sum", "max", "min") and n.args and isinstance(x := self.ev(n.args[0]), TV):
            axis = const_eval(n.args[1] if len(n.args) > 1 else kw.get("axis", ast.Constant(None)), {})
            if not isinstance(axis, int) or len(x.lanes) != 2:
                return self._unknown(n, f"reduction {ast.unparse(n)} over axis {axis}")
            return TV(name, (x,), (x.lanes[1 - axis],), n.lineno, axis)
        if name in _PURE:
            args = [self.ev(a) for a in n.args]
            if all(isinstance(a, Expr) for a in args) and len(args) == (1 if name == "abs" else 2):
                return call(_PURE[name], *args)  # type: ignore[arg-type]
            if any(isinstance(a, TV) for a in args) and all(isinstance(a, (TV, Expr)) for a in args):
                lanes = _tile_lanes(args[0]) if len(args) == 1 else _broadcast(_tile_lanes(args[0]), _tile_lanes(args[1]))
                return TV(_PURE[name], tuple(args), lanes or (), n.lineno)
        return self._unknown(n, f"call {ast.unparse(n.func)}()")

    def _expr(self, node: ast.AST, at: ast.AST) -> Expr:
        v = self.ev(node)
        if not isinstance(v, Expr):
            self._unknown(at, f"{ast.unparse(node)} is not a scalar")
            return var("_unknown")
        return v

    def _zeros(self, n: ast.Call, kw: dict) -> Sym:
        shape = n.args[0] if n.args else kw.get("shape")
        elts = shape.elts if isinstance(shape, (ast.List, ast.Tuple)) else []
        if not elts or (len(n.args) > 1 and n.func and ast.unparse(n.func).endswith("full")
                        and self.ev(n.args[1]) != const(0.0) and self.ev(n.args[1]) != const(0)):
            return self._unknown(n, f"tile constant {ast.unparse(n)}")
        return TV("zeros", (), tuple(self._lane(normal_form(self._expr(e, n))) for e in elts), n.lineno)

    def _load(self, n: ast.Call, kw: dict) -> Sym:
        ptr = self.ev(n.args[0])
        if not isinstance(ptr, Ptr):
            return self._unknown(n, "tl.load of something that is not a pointer")
        mask = self.ev(kw["mask"]) if "mask" in kw else None
        if isinstance(mask, Expr):
            self._compare(mask)
        other = self.ev(kw["other"]) if "other" in kw else const(0.0)
        off = normal_form(ptr.offset)
        lanes = _axes(off)
        if not lanes:  # a scalar (a table or aux value): an index expression
            return load(ptr.base, off)
        return TV("load", (), lanes, n.lineno, (Ptr(ptr.base, off), other))

    def _store(self, n: ast.Call, kind: str, kw: dict) -> Sym:
        ptr, val = self.ev(n.args[0]), self.ev(n.args[1])
        mask = self.ev(kw["mask"]) if "mask" in kw else (self.ev(n.args[2]) if len(n.args) > 2 else None)
        if isinstance(mask, Expr):
            self._compare(mask)
        if not isinstance(ptr, Ptr) or not isinstance(val, (TV, Expr)):
            return self._unknown(n, f"tl.{kind} of {type(val).__name__} through {type(ptr).__name__}")
        self.scope.append(Effect(kind, Ptr(ptr.base, normal_form(ptr.offset)), val, mask if isinstance(mask, Expr) else None,
                                 n.lineno, self._file(n), self.cond))
        return Opaque(kind)

    def _dot(self, n: ast.Call, kw: dict) -> Sym:
        a, b = self.ev(n.args[0]), self.ev(n.args[1])
        if not isinstance(a, TV) or not isinstance(b, TV) or len(a.lanes) != 2 or len(b.lanes) != 2:
            return self._unknown(n, f"tl.dot of non-tiles: {ast.unparse(n)}")
        ta = bool(const_eval(kw["trans_a"], self.consts)) if "trans_a" in kw else False
        tb = bool(const_eval(kw["trans_b"], self.consts)) if "trans_b" in kw else False
        la = a.lanes[::-1] if ta else a.lanes
        lb = b.lanes[::-1] if tb else b.lanes
        if la[1] != lb[0]:
            return self._unknown(n, f"tl.dot at line {n.lineno} contracts lane {la[1]} of its first operand with lane "
                                    f"{lb[0]} of its second (the operands' axes do not match)")
        out = TV("dot", (a, b), (la[0], lb[1]), n.lineno, (ta, tb))
        acc = n.args[2] if len(n.args) > 2 else kw.get("acc")
        if acc is not None:
            base = self.ev(acc)
            return TV("add", (base, out), out.lanes, n.lineno) if isinstance(base, TV) else \
                self._unknown(n, "tl.dot accumulator is not a tile")
        return out

    def _where(self, n: ast.Call) -> Sym:
        c, x, y = (self.ev(a) for a in n.args[:3])
        if isinstance(c, Expr):
            self._compare(c)
        if isinstance(c, Expr) and all(isinstance(v, (Expr, TV)) for v in (x, y)):
            if isinstance(x, Expr) and isinstance(y, Expr):
                return call("where", as_bool(c), x, y)
            lanes = _broadcast(_broadcast(_tile_lanes(x), _tile_lanes(y)) or (), _axes(c)) \
                if _axes(c) and len(_axes(c)) == 2 else _broadcast(_tile_lanes(x), _tile_lanes(y))
            if lanes is None:
                return self._unknown(n, f"tl.where over tiles of different lanes: {ast.unparse(n)}")
            return TV("where", (x, y), lanes, n.lineno, c)
        return self._unknown(n, f"tl.where with a tile condition: {ast.unparse(n)}")

    # ---------------------------------------------------------------- statements
    def run(self, body: list[ast.stmt]) -> bool:
        """Walk `body`; False once a `return` ends it."""
        for st in body:
            if isinstance(st, ast.Return):
                return False
            if isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None:
                for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                    self._assign(t, st.value, st)
            elif isinstance(st, ast.AugAssign):
                target = ast.parse(ast.unparse(st.target), mode="eval").body
                self._assign(st.target, ast.copy_location(ast.BinOp(left=ast.copy_location(target, st), op=st.op,
                                                                    right=st.value), st), st)
            elif isinstance(st, ast.Expr):
                self.ev(st.value)
            elif isinstance(st, ast.For):
                self._for(st)
            elif isinstance(st, ast.If):
                if not self._if(st):
                    return False
            elif not isinstance(st, (ast.Pass, ast.AnnAssign)):
                self._unknown(st, f"statement {type(st).__name__}")
        return True

    def _assign(self, target: ast.AST, value: ast.AST, st: ast.stmt) -> None:
        if isinstance(target, ast.Tuple):
            vals = value.elts if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts) else None
            for i, t in enumerate(target.elts):
                if isinstance(t, ast.Name):
                    self.env[t.id] = self.ev(vals[i]) if vals else self._unknown(st, f"tuple assignment {ast.unparse(st)}")
            return
        if isinstance(target, ast.Name):
            self.env[target.id] = self.ev(value)
        else:
            self._unknown(st, f"assignment to {ast.unparse(target)}")

    def _range(self, st: ast.For) -> tuple[Expr, Expr, Expr] | None:
        it = st.iter
        if not (isinstance(it, ast.Call) and ast.unparse(it.func).split(".")[-1] in ("range", "static_range")):
            return None
        args = [self.ev(a) for a in it.args]
        if not 1 <= len(args) <= 3 or not all(isinstance(a, Expr) for a in args):
            return None
        lo, hi, step = (const(0), args[0], const(1)) if len(args) == 1 else \
            (args[0], args[1], args[2] if len(args) == 3 else const(1))
        return normal_form(lo), normal_form(hi), normal_form(step)  # type: ignore[arg-type]

    def _for(self, st: ast.For) -> None:
        bounds = self._range(st)
        if bounds is None or not isinstance(st.target, ast.Name):
            self._unknown(st, f"loop {ast.unparse(st.iter)} is not a range over scalars")
            return
        lo, hi, step = bounds
        lv = self._fresh(st.target.id)
        loop = LoopNode(lv, lo, hi, step, st.lineno, st.end_lineno or st.lineno, self._file(st))
        assigned = {n.id for s in st.body for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        inductions = self._inductions(st, var(lv), lo, step)
        carries: dict[str, TV] = {}
        for name in sorted(assigned):
            cur = self.env.get(name)
            if isinstance(cur, TV):
                carries[name] = TV("carry", (cur,), cur.lanes, st.lineno, name)
                self.env[name] = carries[name]
        self.env.update({k: v for k, v in inductions.items()})
        self.env[st.target.id] = var(lv)
        saved_scope, saved_cond = self.scope, self.cond
        self.scope, self.cond = loop.body, None
        self.run(st.body)
        self.scope, self.cond = saved_scope, saved_cond
        if saved_cond is not None:  # a loop under a runtime `if` runs empty when the condition is false
            loop.hi = call("where", saved_cond, loop.hi, loop.lo)
        for name, carry in carries.items():
            final = self.env.get(name)
            loop.carried[name] = (carry, final)
            self.env[name] = TV("loop_out", (carry, final), carry.lanes, st.lineno, loop) if isinstance(final, TV) \
                else self._unknown(st, f"{name} is a tile before the loop at line {st.lineno} and not after it")
        for name in inductions:
            self.env[name] = Opaque(f"{name} after the loop at line {st.lineno}")
        self.scope.append(loop)

    def _inductions(self, st: ast.For, i: Expr, lo: Expr, step: Expr) -> dict[str, Sym]:
        """`x += d` / `x = x + d` at the top of the body, with x a pointer or scalar before the loop and d
        loop-invariant: x is `x0 + (i - lo) / step * d` in iteration i."""
        out: dict[str, Sym] = {}
        for s in st.body:
            if (inc := _increment(s)) is None:
                continue
            name, delta = inc
            if not isinstance(cur := self.env.get(name), (Ptr, Expr)):
                continue
            if any(isinstance(n, ast.Name) and n.id in _stored_names(st) for n in ast.walk(delta)):
                continue
            d = self.ev(delta)
            if not isinstance(d, Expr):
                continue
            k = _trip_scaled(d, i, lo, step)
            out[name] = Ptr(cur.base, cur.offset + k) if isinstance(cur, Ptr) else cur + k
        return out

    def _if(self, st: ast.If) -> bool:
        test = self.ev(st.test)
        if not isinstance(test, Expr):
            self._unknown(st, f"if on a tile value: {ast.unparse(st.test)}")
            return True
        cond = as_bool(test)
        self._compare(cond)
        if st.body and isinstance(st.body[-1], ast.Return):
            return self._early_exit(st, cond)
        before = dict(self.env)
        outer = self.cond
        self.cond = cond if outer is None else outer & cond
        cont = self.run(st.body)
        then_env, self.env = self.env, dict(before)
        neg = ~cond
        self.cond = neg if outer is None else outer & neg
        cont_else = self.run(st.orelse)
        else_env, self.cond = self.env, outer
        self.env = {**else_env, **{k: _merge(cond, v, else_env.get(k), st.lineno) for k, v in then_env.items()
                                   if else_env.get(k) is not v}}
        return cont or cont_else

    def _early_exit(self, st: ast.If, cond: Expr) -> bool:
        saved_env, saved_scope = dict(self.env), self.scope
        effects: list = []
        self.scope = effects
        self.run(st.body[:-1])
        self.env, self.scope = saved_env, saved_scope
        self.scope.append(EarlyExit(cond, effects, st.lineno, st.end_lineno or st.lineno))
        return True


def _tile_lanes(x: Sym) -> tuple:
    return x.lanes if isinstance(x, TV) else ()


def _merge(cond: Expr, a: Sym, b: Sym | None, line: int) -> Sym:
    if isinstance(a, Expr) and isinstance(b, Expr):
        return normal_form(call("where", cond, a, b))
    if isinstance(a, TV) and isinstance(b, TV) and a.lanes == b.lanes:
        return TV("select", (a, b), a.lanes, line, cond)
    return Opaque(f"differs by branch at line {line}")


def _increment(s: ast.stmt) -> tuple[str, ast.expr] | None:
    if isinstance(s, ast.AugAssign) and isinstance(s.op, ast.Add) and isinstance(s.target, ast.Name):
        return s.target.id, s.value
    if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name) \
            and isinstance(s.value, ast.BinOp) and isinstance(s.value.op, ast.Add) \
            and isinstance(s.value.left, ast.Name) and s.value.left.id == s.targets[0].id:
        return s.targets[0].id, s.value.right
    return None


def _stored_names(st: ast.For) -> set[str]:
    return {n.id for s in st.body for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _trip_scaled(d: Expr, i: Expr, lo: Expr, step: Expr) -> Expr:
    """(i - lo) / step * d, exactly: step divides every monomial of d (`BLOCK_M * stride`) or is 1."""
    span = i - lo
    if step == const(1):
        return normal_form(span * d)
    poly = to_poly(d)
    if step.op is ExprOp.VAR and poly and all(step in mono for mono in poly):
        per = {}
        for mono, c in poly.items():
            rest = list(mono)
            rest.remove(step)
            per[tuple(rest)] = c
        return normal_form(span * from_poly(per))
    return span // step * d



def walk_tiles(mod: TritonModule, fn: JitFn, body: list[ast.stmt], consts: dict[str, object]) -> TileWalk:
    """Walk the specialized `body` of `fn` (flags folded, helpers inlined) into its tile dataflow."""
    w = _TileWalker(mod, fn, body, consts)
    w.run(body)
    return w.out

