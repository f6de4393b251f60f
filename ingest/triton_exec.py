"""Symbolic walk of one specialized Triton kernel: index math to IR expressions, tile idioms to events.

The walker keeps an environment from source names to symbolic values:
- `Expr` for scalars and index vectors (lanes `_r`, `_c`, `_d` stand for `tl.arange` over
  BLOCK_M, BLOCK_N and the head dim; `lane_to_idx` turns them into `q_idx` / `kv_idx`);
- `Ptr` for pointer arithmetic (a base param plus an offset expression over strides);
- `Tile` for tile values, with the idioms they came from (`score`, `pv`, `rowmax`, ...).
Kernel-scope scalar assignments become IR `let`s (named after the source variable); loops
over KV blocks become `Loop`s with the events seen in their body; runtime `if`s on scalars
become `where(...)`. Every event keeps its source line, so snippets point at real code.

Invariant: the walker never guesses a value: what it cannot translate becomes `Opaque`
and is listed in `unknown` with its line.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field

from kb.ir.expr import Expr, ExprOp, call, const, free_vars, load, number, parse_expr, substitute, var, walk
from ingest.model import as_int
from ingest.triton_dims import BLOCK_MAKERS, infer_dims, is_range_call
from ingest.triton_source import TritonModule, Unknown, const_eval, node_file
from kb.ir.algebra import from_poly, normal_form, to_poly

__all__ = ["MASK_FILL", "Tile", "Ptr", "BlockPtr", "TensorDesc", "Opaque", "Event", "Loop", "KernelWalk", "walk_kernel", "LANES", "LOG2E", "lane_to_idx",
           "DIM_PATTERNS"]

LOG2E = 1.4426950408889634
MASK_FILL = -1e4  # a where-fill at or below this masks the score (exp of it underflows to 0 in fp32)
LANES = ("_r", "_c", "_d")

# Names kept as hints where use cannot decide: the IR's split-KV axis and the head groups of a 5-D
# decode layout (the IR has none: G = 1). Batch and head counts, the KV head count and the group size
# are found by use (`lift_triton._roles`): the divisor splitting a fused batch*head program id, the
# ratio in the KV head index `h // (Hq // Hkv)`; sequence lengths, head dim and block sizes by
# `ingest.triton_dims`.
DIM_PATTERNS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^(split_k|NUM_SPLITS)$"), "NUM_SPLITS"),
    (re.compile(r"^(G_q|G)$"), "1"),
    (re.compile(r"PER_SPLIT"), "cdiv(cdiv(N, NUM_SPLITS), BLOCK_N) * BLOCK_N"),
)
# The softmax scale by name is a hint; by use it is the scalar parameter that multiplies the scores
# (reported as a `scale_param` event, bound by the lifter on its second walk).
_SCALE = re.compile(r"(?i)^(sm_scale|softmax_scale)$")


@dataclass(frozen=True)
class Tile:
    deps: frozenset[str]


@dataclass(frozen=True)
class Ptr:
    base: str
    offset: Expr


@dataclass(frozen=True)
class BlockPtr:
    """`tl.make_block_ptr`: a base pointer, per-dim strides and offsets, and the lane each block dim spans."""
    base: Ptr
    strides: tuple[Expr, ...]
    offsets: tuple[Expr, ...]
    lanes: tuple[str, ...]

    def element(self, offsets: tuple[Expr, ...] | None = None) -> Ptr:
        """The pointer of one tile element: base + sum((offset_i + lane_i) * stride_i)."""
        off = self.base.offset
        for o, lane, st in zip(offsets or self.offsets, self.lanes, self.strides):
            off = off + (o + var(lane)) * st
        return Ptr(self.base.base, off)


@dataclass(frozen=True)
class TensorDesc:
    """`tl.make_tensor_descriptor`: like a block pointer whose offsets come with each `load`/`store`."""
    block: BlockPtr


@dataclass(frozen=True)
class Opaque:
    text: str


Sym = Expr | Tile | Ptr | BlockPtr | TensorDesc | Opaque


@dataclass(frozen=True)
class Event:
    kind: str  # score_dot, pv_dot, scale, finite_fill, mask, score_term, rowmax, colmax, rowsum, colsum, exp, exp2, log, log2, store, load, rescale, where_tile
    line: int
    file: str
    payload: object = None  # its shape depends on the kind: read it through the typed views below
    cond: Expr | None = None  # runtime condition the event sits under

    def expr(self) -> Expr:
        """mask, score_term, scale: the condition or term."""
        assert isinstance(self.payload, Expr), self.kind
        return self.payload

    def name(self) -> str:
        """pv_dot: the v tensor; scale_param: the parameter; reload: the tensor."""
        assert isinstance(self.payload, str), self.kind
        return self.payload

    def deps(self) -> frozenset[str]:
        """rowmax, colsum, exp2, ...: the idioms the operand came from."""
        assert isinstance(self.payload, frozenset), self.kind
        return self.payload

    def operands(self) -> tuple[str, str]:
        """score_dot: the q and k tensors."""
        assert isinstance(self.payload, tuple), self.kind
        q, k = self.payload
        return q, k

    def loaded(self) -> tuple[str, Expr]:
        """load: the tensor and the offset read."""
        assert isinstance(self.payload, tuple), self.kind
        base, offset = self.payload
        return base, offset

    def indexed(self) -> tuple[str, tuple[tuple[str, Expr], ...]]:
        """aux_load, index_load: the tensor and its (stride, index) terms."""
        assert isinstance(self.payload, tuple), self.kind
        base, terms = self.payload
        return base, terms

    def stored(self) -> tuple[str | None, frozenset[str], Expr | None]:
        """store: the tensor and the offset (None for a pointer not understood), and the idioms of the value."""
        assert isinstance(self.payload, tuple), self.kind
        base, deps, offset = self.payload
        return base, deps, offset


@dataclass
class Loop:
    var: str  # IR loop variable
    lo: Expr
    hi: Expr
    line: int
    end_line: int
    events: list[Event] = field(default_factory=list)


@dataclass
class KernelWalk:
    lets: list = field(default_factory=list)  # ("let", name, Expr) | ("loop", Loop)
    events: list[Event] = field(default_factory=list)  # kernel scope
    loops: list[Loop] = field(default_factory=list)
    unknown: list[tuple[int, str]] = field(default_factory=list)
    early_exits: list[tuple[int, int]] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)  # source param -> role ("ptr", "dim:X", "scale", "other")
    pids: dict[int, str] = field(default_factory=dict)


_RESERVED = {"b", "h", "m", "s", "hk", "q_idx", "kv_idx", "score", "q", "k", "v", "o", "lse", "m_start", "inf",
             "B", "Hq", "Hkv", "M", "N", "D", "BLOCK_M", "BLOCK_N", "NUM_SPLITS", "HEAD_PAD", "sm_scale",
             *LANES}


def is_bool(e: Expr) -> bool:
    return e.op in (ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE, ExprOp.EQ, ExprOp.NE, ExprOp.AND, ExprOp.OR,
                    ExprOp.NOT) or (e.op is ExprOp.CONST and isinstance(e.value, bool))


def _as_int(e: Expr) -> Expr:
    return call("where", e, const(1), const(0)) if is_bool(e) else e


def as_bool(e: Expr) -> Expr:
    return e if is_bool(e) else e.ne(0)


def bool_chain(op: ast.boolop, vals: list[Expr]) -> Expr:
    """`a and b and ...` / `a or b or ...` over expressions, each taken as a truth value."""
    out = as_bool(vals[0])
    for v in vals[1:]:
        out = Expr(ExprOp.AND if isinstance(op, ast.And) else ExprOp.OR, (out, as_bool(v)))
    return out


def lane_to_idx(e: Expr, loop_var: str = "n_start") -> Expr:
    """Lanes to absolute indices: `_r = q_idx - m * BLOCK_M`, `_c = kv_idx - loop_var` (then simplified)."""
    m_start = var("m") * var("BLOCK_M")
    return normal_form(substitute(e, {"_r": var("q_idx") - m_start, "_c": var("kv_idx") - var(loop_var)}))


def _has_lanes(e: Expr) -> bool:
    return bool(free_vars(e) & set(LANES))


def _num_of(e: Sym) -> float | None:
    if isinstance(e, Expr) and e.op is ExprOp.CONST and not isinstance(e.value, bool):
        return float(number(e))
    if isinstance(e, Expr) and e.op is ExprOp.NEG:
        v = _num_of(e.args[0])
        return None if v is None else -v
    return None


_BIN = {ast.Add: ExprOp.ADD, ast.Sub: ExprOp.SUB, ast.Mult: ExprOp.MUL, ast.Div: ExprOp.DIV,
        ast.FloorDiv: ExprOp.FLOORDIV, ast.Mod: ExprOp.MOD, ast.BitAnd: ExprOp.AND, ast.BitOr: ExprOp.OR}
_CMP = {ast.Lt: ExprOp.LT, ast.LtE: ExprOp.LE, ast.Gt: ExprOp.GT, ast.GtE: ExprOp.GE, ast.Eq: ExprOp.EQ,
        ast.NotEq: ExprOp.NE}
_PURE_CALLS = {"cdiv": "cdiv", "minimum": "minimum", "maximum": "maximum", "min": "minimum", "max": "maximum",
               "abs": "abs"}


class _Walker:
    def __init__(self, mod: TritonModule, fn: ast.FunctionDef, consts: dict[str, object], overrides: dict[str, Expr],
                 dims: dict[str, str], value_roles: dict[Expr, Expr] | None = None):
        self.mod, self.consts, self.overrides, self.dims = mod, consts, overrides, dims
        self.value_roles = value_roles or {}
        self.out = KernelWalk()
        self.env: dict[str, Sym] = {}
        self.used_names: set[str] = set()
        self.loop: Loop | None = None
        self.scalars = _scalar_params(fn)
        self.cond: Expr | None = None
        self.collect: list | None = None
        self.stored: dict[tuple[str, str], Tile] = {}
        self.load_lanes: dict[str, frozenset[str]] = {}  # loaded tile -> its lanes (q of a decode row has no `_c`)
        for a in fn.args.args:
            self.env[a.arg] = self._param(a.arg)

    # ---- params
    def _param(self, name: str) -> Sym:
        if name in self.overrides:
            return self.overrides[name]
        if name in self.dims:
            self.out.params[name] = f"dim:{self.dims[name]}"
            return var(self.dims[name])
        for pat, dim in DIM_PATTERNS:
            if pat.search(name):
                self.out.params[name] = f"dim:{dim}"
                return parse_expr(dim)
        if _SCALE.search(name):
            self.out.params[name] = "scale"
            return var("sm_scale")
        if name in getattr(self, "scalars", ()):
            self.out.params[name] = "scalar"
            return var(name)
        if name in self.consts and isinstance(self.consts[name], (bool, int, float, str)):
            c = self.consts[name]
            return const(c) if not isinstance(c, str) else Opaque(c)  # type: ignore[arg-type]
        self.out.params[name] = "ptr"
        return Ptr(name, const(0))

    # ---- events
    def _event(self, kind: str, node: ast.AST, payload: object = None) -> None:
        ev = Event(kind, getattr(node, "lineno", 0), node_file(node, self.mod.file), payload, self.cond)
        (self.loop.events if self.loop is not None else self.out.events).append(ev)

    def _unknown(self, node: ast.AST, what: str) -> Opaque:
        self.out.unknown.append((getattr(node, "lineno", 0), what))
        return Opaque(what)

    # ---- expressions
    def ev(self, n: ast.AST) -> Sym:
        if isinstance(n, ast.Constant):
            if isinstance(n.value, (bool, int, float)):
                return const(n.value)
            return Opaque(repr(n.value))
        if isinstance(n, ast.Name):
            if n.id in self.env:
                return self.env[n.id]
            if n.id in self.consts and isinstance(self.consts[n.id], (bool, int, float)):
                return const(self.consts[n.id])  # type: ignore[arg-type]
            return Opaque(n.id)
        if isinstance(n, ast.Subscript):  # x[:, None] / x[None, :]: broadcasting only
            return self.ev(n.value)
        if isinstance(n, ast.Tuple):
            return Opaque("tuple")
        if isinstance(n, ast.UnaryOp):
            v = self.ev(n.operand)
            if isinstance(v, Expr):
                if isinstance(n.op, ast.USub):
                    return const(-number(v)) if v.op is ExprOp.CONST else -v
                if isinstance(n.op, (ast.Not, ast.Invert)):
                    return ~as_bool(v)
            return v if isinstance(v, Tile) else Opaque(ast.unparse(n))
        if isinstance(n, ast.BoolOp):
            vals = [self.ev(v) for v in n.values]
            if all(isinstance(v, Expr) for v in vals):
                return bool_chain(n.op, vals)  # type: ignore[arg-type]
            return Opaque(ast.unparse(n))
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in _CMP:
            a, b = self.ev(n.left), self.ev(n.comparators[0])
            if isinstance(a, Tile) or isinstance(b, Tile):
                return Tile(_deps(a) | _deps(b) | {"compare"})
            if isinstance(a, Expr) and isinstance(b, Expr):
                return Expr(_CMP[type(n.ops[0])], (a, b))
            return Opaque(ast.unparse(n))
        if isinstance(n, ast.IfExp):
            try:
                return self.ev(n.body if const_eval(n.test, self.consts) else n.orelse)
            except Unknown:
                t, a, b = self.ev(n.test), self.ev(n.body), self.ev(n.orelse)
                if all(isinstance(x, Expr) for x in (t, a, b)):
                    return call("where", as_bool(t), a, b)  # type: ignore[arg-type]
                return Opaque(ast.unparse(n))
        if isinstance(n, ast.BinOp):
            return self._binop(n)
        if isinstance(n, ast.Call):
            return self._call(n)
        if isinstance(n, ast.Attribute):
            base = self.ev(n.value) if n.attr == "T" else None
            return base if isinstance(base, Tile) else Opaque(ast.unparse(n))
        return self._unknown(n, f"unsupported syntax {type(n).__name__}")

    def _binop(self, n: ast.BinOp) -> Sym:
        a, b = self.ev(n.left), self.ev(n.right)
        op = _BIN.get(type(n.op))
        if op is None:
            return self._unknown(n, f"operator {type(n.op).__name__}")
        if isinstance(a, Ptr) and isinstance(b, Ptr) and op is ExprOp.ADD:
            pa, pb = a, b  # both calls see the two pointers (mypy re-types a before checking the second)
            a, b = self._offset_param(pa, pb), self._offset_param(pb, pa)
        if isinstance(a, Ptr) and isinstance(b, Expr) and op is ExprOp.ADD:
            return Ptr(a.base, a.offset + b)
        if isinstance(b, Ptr) and isinstance(a, Expr) and op is ExprOp.ADD:
            return Ptr(b.base, b.offset + a)
        if isinstance(a, Tile) or isinstance(b, Tile):
            deps = _deps(a) | _deps(b)
            other = b if isinstance(a, Tile) else a
            if op is ExprOp.MUL and isinstance(other, Expr) and "sm_scale" in free_vars(other):
                self._event("scale", n, other)
            elif op is ExprOp.MUL and isinstance(other, Expr) and "score" in deps:
                scalars = sorted(v for v in free_vars(other) if self.out.params.get(v) == "scalar")
                if len(scalars) == 1:
                    self._event("scale_param", n, scalars[0])
            if op is ExprOp.MUL and isinstance(other, Expr) and other.op is ExprOp.CONST \
                    and abs(number(other) - LOG2E) < 1e-6:
                deps = deps | {"log2e"}
            if op is ExprOp.MUL and isinstance(other, Expr) and other.op is ExprOp.CONST \
                    and abs(number(other) - math.log(2)) < 1e-6:
                deps = deps | {"ln2"}
            if op is ExprOp.DIV and isinstance(b, Expr) and (nb := _num_of(b)) is not None and abs(nb - LOG2E) < 1e-6:
                deps = deps | {"ln2"}
            if op is ExprOp.MUL and isinstance(a, Tile) and isinstance(b, Tile):
                product = self._product(a, b)
                if product is not None:  # reduced by tl.sum into a score or PV dot
                    return product
                for x, y in ((a, b), (b, a)):
                    if "init_acc" in x.deps and "rowmax" in y.deps:
                        self._event("rescale", n)
                        break
            if op in (ExprOp.ADD, ExprOp.SUB) and isinstance(other, Expr) and _has_lanes(other) \
                    and ("score" in _deps(a) or "score" in _deps(b)):
                self._event("score_term", n, other if op is ExprOp.ADD else -other)
            return Tile(deps)
        if isinstance(a, Expr) and isinstance(b, Expr):
            if op in (ExprOp.ADD, ExprOp.SUB, ExprOp.MUL):
                a, b = _as_int(a), _as_int(b)
            if op in (ExprOp.FLOORDIV, ExprOp.MOD) and b == const(1):  # a group count of 1 (G = 1)
                return a if op is ExprOp.FLOORDIV else const(0)
            return Expr(op, (a, b))
        return Opaque(ast.unparse(n))

    def _product(self, a: Tile, b: Tile) -> Tile | None:
        """`q[None, :] * k` (a q row times a k tile) or `p[:, None] * v`: a dot once `tl.sum` reduces it."""
        la, lb = ({d[5:] for d in x.deps if d.startswith("load:")} for x in (a, b))
        if len(la) == 1 and len(lb) == 1 and not {"score"} & (a.deps | b.deps):
            (qa,), (qb,) = la, lb
            if "_c" in self.load_lanes.get(qa, ()) and "_c" not in self.load_lanes.get(qb, ()):
                qa, qb = qb, qa
            return Tile(frozenset({f"qk_prod:{qa}:{qb}"}))
        for p, v, lv in ((a, b, lb), (b, a, la)):
            if "score" in p.deps and "vec" in p.deps and len(lv) == 1 and "score" not in v.deps:
                return Tile(frozenset({f"pv_prod:{next(iter(lv))}"}))
        return None

    def _reduced_product(self, n: ast.Call, deps: frozenset[str], axis: object) -> Tile | None:
        """`tl.sum(q[None, :] * k, 1)` is the score dot of a 1-row tile, `tl.sum(p[:, None] * v, 0)` its PV dot."""
        for d in deps:
            if d.startswith("qk_prod:") and axis == 1:
                _, q, k = d.split(":")
                self._event("score_dot", n, (q, k))
                return Tile(frozenset({"score", "vec"}))
            if d.startswith("pv_prod:") and axis == 0:
                self._event("pv_dot", n, d.split(":")[1])
                return Tile(frozenset({"pv"}))
        return None

    def _offset_param(self, p: Ptr, other: Ptr) -> Sym:
        """In `ptr + x`, a bare parameter `x` added to a pointer that already carries an offset is an integer
        offset (`metadata_ptr + stride_m2`), not a second pointer."""
        bare = p.offset == const(0) and self.out.params.get(p.base) == "ptr"
        if bare and other.offset != const(0):
            self.out.params[p.base] = "scalar"
            return var(p.base)
        return p

    def _fname(self, n: ast.Call) -> str:
        f = ast.unparse(n.func)
        return f.split(".")[-1]

    def _call(self, n: ast.Call) -> Sym:
        full, name = ast.unparse(n.func), self._fname(n)
        kw = {k.arg: k.value for k in n.keywords if k.arg}
        if isinstance(n.func, ast.Attribute) and name == "to":
            return self.ev(n.func.value)
        if name == "program_id":
            pid_axis = as_int(const_eval(n.args[0], {})) if n.args else as_int(const_eval(kw["axis"], {}))
            return self.overrides.get(f"pid{pid_axis}", var(f"pid{pid_axis}"))
        if name == "arange":
            hi = self.ev(n.args[1])
            lane = "_r" if hi == var("BLOCK_M") else "_c" if hi == var("BLOCK_N") else "_d"
            return var(lane)
        if name in ("multiple_of", "trans") and n.args:  # a transposed tile is the same operand to the idioms
            return self.ev(n.args[0])
        if name == "float" and n.args:
            try:
                return const(float(const_eval(n.args[0], {})))  # type: ignore[arg-type]
            except (Unknown, ValueError):
                return Opaque(full)
        if name in ("zeros", "full"):
            if name == "full" and len(n.args) > 1:
                val = self.ev(n.args[1])
                dt = ast.unparse(kw.get("dtype", n.args[2] if len(n.args) > 2 else ast.Constant(None)))
                if isinstance(val, Expr) and "int" in dt:
                    return val
            shape = n.args[0] if n.args else kw.get("shape")
            elts = shape.elts if isinstance(shape, (ast.List, ast.Tuple)) else []
            last = self.ev(elts[-1]) if elts else None
            if len(elts) == 1:  # a row statistic, or the accumulator of a 1-row (decode) tile over the head dim
                tag = "init_acc" if last == var("HEAD_PAD") else "init_row"
            else:
                tag = "init_s" if last == var("BLOCK_N") else "init_acc"
            return Tile(frozenset({"init", tag}))
        if name == "cdiv" or (name in _PURE_CALLS and not any(isinstance(self.ev(a), Tile) for a in n.args)):
            args = [self.ev(a) for a in n.args]
            if all(isinstance(a, Expr) for a in args) and len(args) == (1 if name == "abs" else 2):
                return call(_PURE_CALLS.get(name, name), *args)  # type: ignore[arg-type]
            return self._unknown(n, f"{full}() on untranslatable arguments")
        if isinstance(n.func, ast.Attribute) and name in ("load", "store") \
                and isinstance(desc := self.ev(n.func.value), TensorDesc):
            return self._desc_access(n, desc, name)
        if name in ("make_block_ptr", "make_tensor_descriptor", "_experimental_make_tensor_descriptor"):
            return self._block_ptr(n, name != "make_block_ptr")
        if name == "advance" and len(n.args) == 2:
            bp, deltas = self.ev(n.args[0]), self._exprs(n.args[1])
            if not isinstance(bp, BlockPtr) or deltas is None or len(deltas) != len(bp.offsets):
                return self._unknown(n, "tl.advance of something that is not a block pointer")
            return BlockPtr(bp.base, bp.strides, tuple(o + d for o, d in zip(bp.offsets, deltas)), bp.lanes)
        if name == "load":
            return self._load(n)
        if name == "store":
            ptr, val = self._pointer(self.ev(n.args[0])), self.ev(n.args[1])
            base = ptr.base if isinstance(ptr, Ptr) else None
            self._event("store", n, (base, _deps(val), ptr.offset if isinstance(ptr, Ptr) else None))
            if isinstance(ptr, Ptr) and isinstance(val, Tile):
                self.stored[(ptr.base, str(ptr.offset))] = val
            return Opaque("store")
        if name == "dot":
            a, b = self.ev(n.args[0]), self.ev(n.args[1])
            da, db = _deps(a), _deps(b)
            if any(d.startswith("load:") for d in da) and any(d.startswith("load:") for d in db) and "score" not in da:
                self._event("score_dot", n, (_load_base(da), _load_base(db)))
                return Tile(frozenset({"score"} | {d for d in da if d == "log2e"}))
            if "score" in da and any(d.startswith("load:") for d in db):
                self._event("pv_dot", n, _load_base(db))
                return Tile(frozenset({"pv"}))
            return self._unknown(n, "tl.dot on operands that are not q/k or p/v tiles")
        if name == "where":
            c, x, y = (self.ev(a) for a in n.args[:3])
            fill = _num_of(y)
            ninf = fill is not None and fill <= MASK_FILL
            if isinstance(c, Expr) and ninf and (isinstance(x, Tile) or _num_of(x) == 0.0):
                if fill != -math.inf:  # e.g. vLLM's -1e8: the same as -inf unless a row allows no key at all
                    self._event("finite_fill", n, fill)
                self._event("mask", n, c)
                return x if isinstance(x, Tile) else Tile(frozenset({"mask"}))
            if any(isinstance(v, Tile) for v in (c, x, y)):
                self._event("where_tile", n)
                return Tile(_deps(c) | _deps(x) | _deps(y))
            if all(isinstance(v, Expr) for v in (c, x, y)):
                return call("where", as_bool(c), x, y)  # type: ignore[arg-type]
            return Opaque(full)
        if name in ("max", "sum", "exp", "exp2", "log", "log2") and n.args and isinstance(self.ev(n.args[0]), Tile):
            src = self.ev(n.args[0])
            deps = _deps(src)
            if name in ("max", "sum"):
                axis_node = n.args[1] if len(n.args) > 1 else kw.get("axis")
                axis = const_eval(axis_node, {}) if axis_node is not None else None
                if name == "sum" and (dot := self._reduced_product(n, deps, axis)) is not None:
                    return dot
                row = axis == 1 or "vec" in deps  # a 1-row score vector is reduced along its only axis
                kind = ("row" if row else "col") + name
                self._event(kind, n, deps)
                return Tile(deps | {kind.replace("col", "row")} | ({"colreduce"} if not row else set()))
            self._event(name, n, deps)
            return Tile(deps | {name})
        if name in ("maximum", "minimum"):
            args = [self.ev(a) for a in n.args]
            return Tile(frozenset().union(*(_deps(a) for a in args)))
        if name in ("debug_barrier", "static_print", "device_print"):
            return Opaque(name)
        if name == "rand":
            return self._unknown(n, "tl.rand (dropout RNG)")
        return self._unknown(n, f"call {full}()")

    def _exprs(self, n: ast.AST) -> tuple[Expr, ...] | None:
        """A tuple/list of index expressions, or None if any element is not one."""
        if not isinstance(n, (ast.Tuple, ast.List)):
            return None
        vals = [self.ev(e) for e in n.elts]
        return tuple(vals) if all(isinstance(v, Expr) for v in vals) else None  # type: ignore[arg-type]

    def _lane(self, extent: Sym) -> str:
        return "_r" if extent == var("BLOCK_M") else "_c" if extent == var("BLOCK_N") else "_d"

    def _block_ptr(self, n: ast.Call, descriptor: bool) -> Sym:
        """`make_block_ptr(base, shape, strides, offsets, block_shape, order)` / `make_tensor_descriptor(base, shape, strides, block_shape)`."""
        names = ("base", "shape", "strides", "block_shape") if descriptor else \
            ("base", "shape", "strides", "offsets", "block_shape", "order")
        args = dict(zip(names, n.args)) | {k.arg: k.value for k in n.keywords if k.arg}
        base = self.ev(args["base"]) if "base" in args else None
        strides = self._exprs(args.get("strides"))  # type: ignore[arg-type]
        offsets = (const(0),) * len(strides or ()) if descriptor else self._exprs(args.get("offsets"))  # type: ignore[arg-type]
        shape = args.get("block_shape")
        lanes = tuple(self._lane(self.ev(e)) for e in shape.elts) if isinstance(shape, (ast.Tuple, ast.List)) else ()
        if not isinstance(base, Ptr) or strides is None or offsets is None or len(lanes) != len(strides) \
                or len(set(lanes)) != len(lanes) or len(offsets) != len(strides):
            return self._unknown(n, f"{ast.unparse(n.func)}() with arguments the walker cannot follow")
        bp = BlockPtr(base, strides, offsets, lanes)
        return TensorDesc(bp) if descriptor else bp

    def _desc_access(self, n: ast.Call, desc: TensorDesc, name: str) -> Sym:
        offsets = self._exprs(n.args[0]) if n.args else None
        if offsets is None or len(offsets) != len(desc.block.offsets):
            return self._unknown(n, f"descriptor .{name}() with offsets the walker cannot follow")
        ptr = desc.block.element(offsets)
        if len(offsets) == 2 and free_vars(offsets[0]) & ({"pid1", "pid2", "b", "h"} | self._index_names()):
            self._event("flat_desc", n)
        if name == "load":
            return self._load_ptr(n, ptr)
        val = self.ev(n.args[1]) if len(n.args) > 1 else Opaque("missing value")
        self._event("store", n, (ptr.base, _deps(val), ptr.offset))
        return Opaque("store")

    def _pointer(self, p: Sym) -> Sym:
        return p.element() if isinstance(p, BlockPtr) else p

    def _load(self, n: ast.Call) -> Sym:
        return self._load_ptr(n, self._pointer(self.ev(n.args[0])))

    def _load_ptr(self, n: ast.Call, ptr: Sym) -> Sym:
        if not isinstance(ptr, Ptr):
            return self._unknown(n, "tl.load of a non-pointer")
        off = normal_form(ptr.offset)
        if (ptr.base, str(ptr.offset)) in self.stored:  # store-then-load round trip (compiler workaround)
            self._event("reload", n, ptr.base)
            return self.stored[(ptr.base, str(ptr.offset))]
        if free_vars(off) & set(LANES) == {"_c"}:  # a vector over the KV lanes: an index (table) or a term
            idx = sorted(_stride_indices(off, self._index_names()), key=lambda t: t[0] == "")  # contiguous dim last
            self._event("index_load", n, (ptr.base, tuple(idx)))
            return load(ptr.base.lower(), *(e for _, e in idx))
        if _has_lanes(off):
            self._event("load", n, (ptr.base, off))
            self.load_lanes[ptr.base] = frozenset(free_vars(off) & set(LANES))
            return Tile(frozenset({f"load:{ptr.base}"}))
        # scalar load from an auxiliary tensor: index per stride, in parameter order
        idx = _stride_indices(off, self._index_names())
        if idx is None:
            return self._unknown(n, f"scalar load from {ptr.base} with non-strided offset {off}")
        self._event("aux_load", n, (ptr.base, tuple(idx)))
        return load(ptr.base.lower(), *(e for _, e in idx))

    # ---- statements
    def run(self, body: list[ast.stmt]) -> bool:
        """Walk `body`; False once a `return` ends the kernel."""
        for st in body:
            if isinstance(st, ast.Return):
                return False
            if isinstance(st, (ast.Assign, ast.AnnAssign)):
                if st.value is None:
                    continue
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                for t in targets:
                    self._assign(t, st.value, st)
            elif isinstance(st, ast.AugAssign):
                self._assign(st.target, ast.copy_location(ast.BinOp(left=_load_ctx(st.target), op=st.op, right=st.value), st), st)
            elif isinstance(st, ast.Expr):
                self.ev(st.value)
            elif isinstance(st, ast.For):
                self._for(st)
            elif isinstance(st, ast.If):
                if not self._if(st):
                    return False
            elif isinstance(st, ast.Pass):
                continue
            else:
                self._unknown(st, f"statement {type(st).__name__}")
        return True

    def _assign(self, target: ast.AST, value: ast.AST, st: ast.stmt) -> None:
        if isinstance(target, ast.Tuple):
            vals = value.elts if isinstance(value, ast.Tuple) else None
            for i, t in enumerate(target.elts):
                if isinstance(t, ast.Name):
                    self.env[t.id] = self.ev(vals[i]) if vals else Opaque("tuple item")
            return
        if not isinstance(target, ast.Name):
            self._unknown(st, f"assignment to {ast.unparse(target)}")
            return
        name = target.id
        if name in self.overrides:
            self.env[name] = self.overrides[name]
            return
        val = self.ev(value)
        if isinstance(val, Expr) and self.loop is None and (role := self.value_roles.get(normal_form(val))) is not None:
            self.env[name] = role  # a grid role found by use (e.g. `bh // n_heads` is the batch index)
            return
        if isinstance(val, Expr) and self.loop is None and self.collect is None and not _has_lanes(val) \
                and val.op not in (ExprOp.VAR, ExprOp.CONST) and not self._raw_scalar(val) \
                and "sm_scale" not in free_vars(val) and not any(x.op is ExprOp.LOAD for x in walk(val)) \
                and not any(x.op is ExprOp.CONST and isinstance(x.value, float) for x in walk(val)):
            let = self._fresh(name)
            self.out.lets.append(("let", let, normal_form(val), st.lineno))
            val = var(let)
        self.env[name] = val

    def _index_names(self) -> set[str]:
        return {str(item[1]) for item in self.out.lets if item[0] == "let"}

    def _raw_scalar(self, e: Expr) -> bool:
        """Mentions a scalar parameter whose role is not known yet (a stride, a count before binding)."""
        return any(self.out.params.get(v) == "scalar" for v in free_vars(e))

    def _fresh(self, name: str) -> str:
        base = name if name not in _RESERVED else f"{name}_"
        cand, i = base, 1
        while cand in self.used_names:
            cand, i = f"{base}_{i}", i + 1
        self.used_names.add(cand)
        return cand

    def _for(self, st: ast.For) -> None:
        it = st.iter
        if not (is_range_call(it) and isinstance(st.target, ast.Name)):
            self._unknown(st, "for loop that is not over range()")
            return
        args = [self.ev(a) for a in it.args]
        if len(args) != 3 or not all(isinstance(a, Expr) for a in args) or args[2] != var("BLOCK_N"):
            self._unknown(st, f"loop {ast.unparse(it)} is not range(lo, hi, BLOCK_N)")
            return
        if self.loop is not None:
            self._unknown(st, "nested loop")
            return
        lv = self._fresh("n_start")
        loop = Loop(lv, normal_form(args[0]), normal_form(args[1]), st.lineno, st.end_lineno or st.lineno)  # type: ignore[arg-type]
        saved_cond = self.cond
        self.loop, self.cond = loop, None
        self.env[st.target.id] = var(lv)
        self.run(st.body)
        self.loop, self.cond = None, saved_cond
        if saved_cond is not None:  # a loop under a runtime `if` runs empty when the condition is false
            loop.hi = call("where", saved_cond, loop.hi, loop.lo)
        self.out.loops.append(loop)
        (self.collect if self.collect is not None else self.out.lets).append(("loop", loop))

    def _if(self, st: ast.If) -> bool:
        if st.body and isinstance(st.body[-1], ast.Return):
            self.out.early_exits.append((st.lineno, st.end_lineno or st.lineno))
            return True
        test = self.ev(st.test)
        if not isinstance(test, Expr):
            # a tile-valued condition: record what is inside as conditional events
            self._unknown(st, f"if on a tile value: {ast.unparse(st.test)}")
            return True
        cond = as_bool(test)
        before = dict(self.env)
        outer_cond = self.cond
        self.cond = cond if outer_cond is None else outer_cond & cond
        cont = self.run(st.body)
        then_env = self.env
        self.env = dict(before)
        self.cond = ~cond if outer_cond is None else outer_cond & ~cond

        cont_else = self.run(st.orelse)
        else_env = self.env
        self.cond = outer_cond
        merged = dict(else_env)
        for k, tv in then_env.items():
            ev_ = else_env.get(k)
            if tv == ev_:
                continue
            if isinstance(tv, Expr) and isinstance(ev_, Expr):
                w = normal_form(call("where", cond, tv, ev_))
                if self.loop is None and not _has_lanes(w):
                    let = self._fresh(k)
                    self.out.lets.append(("let", let, w, st.lineno))
                    merged[k] = var(let)
                else:
                    merged[k] = w
            elif isinstance(tv, Tile) or isinstance(ev_, Tile):
                merged[k] = Tile(_deps(tv) | _deps(ev_))
            else:
                merged[k] = tv if ev_ is None else Opaque(f"{k} differs by branch")
        self.env = merged
        return cont or cont_else


def _scalar_params(fn: ast.FunctionDef) -> set[str]:
    """Params used in integer arithmetic (`x * n`, `x // n`, `x % n`) or as block-pointer shapes/strides are scalars."""
    params = {a.arg for a in fn.args.args}
    out: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, (ast.BinOp, ast.AugAssign)) and isinstance(n.op, (ast.Mult, ast.FloorDiv, ast.Mod)):
            sides = (n.left, n.right) if isinstance(n, ast.BinOp) else (n.value,)  # `s *= scale` too
            for side in sides:
                if isinstance(side, ast.Name) and side.id in params:
                    out.add(side.id)
        if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] in BLOCK_MAKERS:
            for k in n.keywords:  # shapes, strides and offsets of block pointers / descriptors are integers
                if k.arg in ("shape", "strides", "offsets") and isinstance(k.value, (ast.Tuple, ast.List)):
                    out |= {e.id for e in k.value.elts if isinstance(e, ast.Name) and e.id in params}
    return out


def _load_ctx(t: ast.AST) -> ast.expr:
    c = ast.parse(ast.unparse(t), mode="eval").body
    return ast.copy_location(c, t)


def _deps(x: Sym | None) -> frozenset[str]:
    return x.deps if isinstance(x, Tile) else frozenset()


def _load_base(deps: frozenset[str]) -> str:
    return sorted(d[5:] for d in deps if d.startswith("load:"))[0]


_INDEX_VARS = {"pid0", "pid1", "pid2", "b", "h", "m", "s", "hk", "BLOCK_M", "BLOCK_N", *LANES}


def _pid_vars(e: Expr) -> frozenset[str]:
    return free_vars(e) & {"pid0", "pid1", "pid2"}


def _stride_indices(off: Expr, index_names: set[str] = frozenset()) -> list[tuple[str, Expr]]:  # type: ignore[assignment]
    """Split a pointer offset into [(stride, index)] by use: `i * s_x + j * s_y + c` -> [("s_x", i), ("s_y", j), ("", c)].

    Index atoms mention a program id, a lane, a loop variable, a grid role, a block size or one of
    `index_names` (the walk's lets); every other factor of a monomial is its stride (a parameter
    or a product such as `H * N * D` in a flattened view). Monomials sharing a stride are summed
    (`(m * BLOCK_M + _r) * s_q2`); the stride "" is the contiguous last dim.
    """
    def is_index(a: Expr) -> bool:
        return any(v in _INDEX_VARS or v in index_names or v.startswith("n_start") for v in free_vars(a))

    groups: dict[str, dict] = {}
    for mono, c in to_poly(off).items():
        key = "*".join(sorted(str(a) for a in mono if not is_index(a)))
        rest = tuple(a for a in mono if is_index(a))
        groups.setdefault(key, {})
        groups[key][rest] = groups[key].get(rest, 0) + c
    return [(k, from_poly(p)) for k, p in groups.items()]


def walk_kernel(mod: TritonModule, fn: ast.FunctionDef, body: list[ast.stmt], consts: dict[str, object],
                overrides: dict[str, Expr], value_roles: dict[Expr, Expr] | None = None) -> KernelWalk:
    """Walk `body`; `overrides` bind source names (params, program ids) and `value_roles` bind values to IR names."""
    w = _Walker(mod, fn, consts, overrides, infer_dims(fn, body, consts), value_roles)
    w.run(body)
    for i, a in enumerate(fn.args.args):
        w.out.params.setdefault(a.arg, "other")
    return w.out


def stride_indices(off: Expr, index_names: set[str] = frozenset()) -> list[tuple[str, Expr]]:  # type: ignore[assignment]
    return _stride_indices(off, index_names)


def uses(e: Expr) -> set[str]:
    return {str(n.value) for n in walk(e) if n.op in (ExprOp.VAR, ExprOp.LOAD)}


__all__ += ["stride_indices", "uses", "as_bool", "is_bool", "bool_chain"]
