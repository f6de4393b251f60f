"""Which kernel parameters are the sequence lengths, head dim and block sizes, from how they are used.

Names do not matter (`N_CTX`, `seqlen_k` and `n` are the same thing when used the same way):
- BLOCK_N: the step of a `for ... in range(lo, hi, X)` loop (the KV loop);
- BLOCK_M: the extent X of a `tl.arange(0, X)` offset by a multiple of X (`start_m * X + tl.arange(0, X)`);
- HEAD_PAD: the extent of any other `tl.arange(0, X)` over a parameter (the head-dim offsets);
  the `block_shape` entries of `tl.make_block_ptr` / `tl.make_tensor_descriptor` count as extents too;
- M, N, D: a parameter that alone bounds query-row, KV or head-dim offsets (`offs_m < n`, in masks
  and `if`s);
  a parameter compared against both row and KV offsets (one `N_CTX` for both) is N; one that only
  bounds the KV loop (`range(lo, seqlen_k, BLOCK_N)`) is N.

Offsets are tracked through local assignments (`cols = start_n + offs_n` is a KV offset, the
loop variable is one too), and parameters through local aliases (`seqlen_q = MAX_SEQLENS_Q`).
Invariant: only parameters of the kernel are classified; anything ambiguous is left out (the
walker then falls back to its table of known names).
"""

from __future__ import annotations

import ast
from typing import TypeGuard

__all__ = ["infer_dims", "is_range_call", "RANGE_CALLS", "BLOCK_MAKERS"]

_LANE_DIM = {"q": "M", "kv": "N", "d": "D"}


RANGE_CALLS = ("range", "tl.range", "tl.static_range", "triton.language.range", "triton.language.static_range")
BLOCK_MAKERS = ("make_block_ptr", "make_tensor_descriptor", "_experimental_make_tensor_descriptor")


def is_range_call(n: ast.AST) -> TypeGuard[ast.Call]:
    """`range(...)`, `tl.range(...)` or `tl.static_range(...)`: the loops the walker can follow."""
    return isinstance(n, ast.Call) and ast.unparse(n.func) in RANGE_CALLS


def _arange_extent(n: ast.AST, names: dict[str, str]) -> str | None:
    if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "arange" and len(n.args) == 2 \
            and isinstance(n.args[1], ast.Name):
        return names.get(n.args[1].id, n.args[1].id)
    return None


def _extents(n: ast.AST, names: dict[str, str]) -> list[str]:
    """Tile extents a node introduces: a `tl.arange(0, X)`, or the `block_shape` of a block pointer/descriptor."""
    x = _arange_extent(n, names)
    if x is not None:
        return [x]
    if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] in BLOCK_MAKERS:
        shape = next((k.value for k in n.keywords if k.arg == "block_shape"), None)
        if isinstance(shape, (ast.Tuple, ast.List)):
            return [names.get(e.id, e.id) for e in shape.elts if isinstance(e, ast.Name)]
    return []


def _range_step(st: ast.For, names: dict[str, str]) -> str | None:
    it = st.iter
    if is_range_call(it) and len(it.args) == 3 \
            and isinstance(it.args[2], ast.Name):
        return names.get(it.args[2].id, it.args[2].id)
    return None


def _renames(stmts: list[ast.stmt]) -> dict[str, str]:
    """`x = y` copies (inlined helpers bind their parameters so), followed to the first name."""
    out: dict[str, str] = {}
    for st in stmts:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) \
                and isinstance(st.value, ast.Name):
            out[st.targets[0].id] = out.get(st.value.id, st.value.id)
    return out


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Every statement in source order, nested bodies included."""
    out: list[ast.stmt] = []
    for st in body:
        out.append(st)
        for sub in ("body", "orelse"):
            out += _statements(getattr(st, sub, []) or [])
    return out


def _derived(stmts: list[ast.stmt]) -> dict[str, set[str]]:
    """Locals -> the names their assigned values read (`VALID_BLOCK_H = BLOCK_H if ... else G`): a row offset
    `pid * VALID_BLOCK_H + tl.arange(0, BLOCK_H)` steps by a size derived from the lane's extent."""
    out: dict[str, set[str]] = {}
    for st in stmts:
        target = st.targets[0] if isinstance(st, ast.Assign) and len(st.targets) == 1 else getattr(st, "target", None)
        if isinstance(st, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Name) and st.value is not None:
            out.setdefault(target.id, set()).update(n.id for n in ast.walk(st.value) if isinstance(n, ast.Name))
    return out


def _block_sizes(stmts: list[ast.stmt], params: set[str]) -> dict[str, str]:
    """BLOCK_N, BLOCK_M and HEAD_PAD; none at all without a KV loop (a kernel that is not a forward pass)."""
    dims: dict[str, str] = {}
    names = _renames(stmts)
    derived = _derived(stmts)
    for st in stmts:
        if isinstance(st, ast.For) and (step := _range_step(st, names)) in params:
            dims[step] = "BLOCK_N"
    for st in stmts:
        value = getattr(st, "value", None)
        if not isinstance(st, (ast.Assign, ast.AnnAssign)) or value is None:
            continue
        extents = {x for n in ast.walk(value) for x in _extents(n, names) if x in params and x not in dims}
        scaled = {names.get(side.id, side.id) for n in ast.walk(value) if isinstance(n, ast.BinOp)
                  and isinstance(n.op, ast.Mult) for side in (n.left, n.right) if isinstance(side, ast.Name)}
        for x in extents & (scaled | {p for s in scaled for p in derived.get(s, ())}):
            dims[x] = "BLOCK_M"
    if "BLOCK_N" not in dims.values():
        return {}
    for st in stmts:
        for n in ast.walk(st):
            for x in _extents(n, names):
                if x in params and x not in dims:
                    dims[x] = "HEAD_PAD"
    return dims


class _Uses:
    """Lane tags of locals (q / kv / d offsets) and the parameters each local stands for."""

    def __init__(self, params: set[str], blocks: dict[str, str], names: dict[str, str]) -> None:
        self.params, self.blocks, self.names = params, blocks, names
        self.lanes: dict[str, set[str]] = {}
        self.alias: dict[str, set[str]] = {}
        self.seen: dict[str, set[str]] = {}  # param -> lanes it was compared against, or "loop"

    def lanes_of(self, e: ast.AST) -> set[str]:
        out: set[str] = set()
        for n in ast.walk(e):
            if isinstance(n, ast.Name):
                out |= self.lanes.get(n.id, set())
            x = _arange_extent(n, self.names)
            if x in self.blocks:
                out.add({"BLOCK_M": "q", "BLOCK_N": "kv", "HEAD_PAD": "d"}[self.blocks[x]])
        return out

    def params_of(self, e: ast.AST) -> set[str]:
        out: set[str] = set()
        for n in ast.walk(e):
            if isinstance(n, ast.Name):
                out |= self.alias.get(n.id, {n.id} & self.params)
        return out - set(self.blocks)

    def assign(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name) and target.id not in self.params:
            lanes = self.lanes_of(value)
            self.lanes[target.id] = lanes
            # a value loaded through a pointer parameter (a varlen length) is not that parameter
            loaded = any(isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "load" for n in ast.walk(value))
            self.alias[target.id] = set() if lanes or loaded else self.params_of(value)

    def compare(self, n: ast.Compare) -> None:
        """`offs < n` bounds one kind of offsets by one parameter; `==` and mixed sides are no evidence."""
        if len(n.ops) != 1 or not isinstance(n.ops[0], (ast.Lt, ast.LtE, ast.Gt, ast.GtE)):
            return
        for side, other in ((n.left, n.comparators[0]), (n.comparators[0], n.left)):
            lanes, bound = self.lanes_of(side), self.params_of(other)
            if len(lanes) == 1 and not self.lanes_of(other) and len(bound) == 1:
                self.seen.setdefault(bound.pop(), set()).update(lanes)

    def loop(self, st: ast.For) -> None:
        if isinstance(st.target, ast.Name):
            self.lanes[st.target.id] = {"kv"}
        it = st.iter
        if isinstance(it, ast.Call) and len(it.args) == 3:
            for p in self.params_of(it.args[1]):
                self.seen.setdefault(p, set()).add("loop")


def _walk_uses(uses: _Uses, body: list[ast.stmt]) -> None:
    for st in body:
        for n in ast.walk(st.test if isinstance(st, ast.If) else st) if not isinstance(st, ast.For) else ():
            if isinstance(n, ast.Compare):
                uses.compare(n)
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            uses.assign(st.targets[0], st.value)
        elif isinstance(st, ast.AnnAssign) and st.value is not None:
            uses.assign(st.target, st.value)
        elif isinstance(st, ast.For):
            uses.loop(st)
            _walk_uses(uses, st.body)
        elif isinstance(st, ast.If):
            _walk_uses(uses, st.body)
            _walk_uses(uses, st.orelse)


def _sizes(seen: dict[str, set[str]]) -> dict[str, str]:
    dims: dict[str, str] = {}
    for p, lanes in seen.items():
        compared = lanes - {"loop"}
        if "kv" in compared or compared == set() and "loop" in lanes:
            dims[p] = "N"
        elif compared == {"q"}:
            dims[p] = "M"
        elif compared == {"d"}:
            dims[p] = "D"
    return dims


def infer_dims(fn: ast.FunctionDef, body: list[ast.stmt], consts: dict[str, object]) -> dict[str, str]:
    """Parameter name -> IR dim (M, N, D, BLOCK_M, BLOCK_N, HEAD_PAD) for the parameters used as one.

    `body` is the specialized body (flags folded, helpers inlined); parameters with a value in
    `consts` (feature flags) are never sizes.
    """
    params = {a.arg for a in fn.args.args} - set(consts)
    stmts = _statements(body)
    blocks = _block_sizes(stmts, params)
    if not blocks:
        return {}
    uses = _Uses(params, blocks, _renames(stmts))
    _walk_uses(uses, body)
    return {**_sizes(uses.seen), **blocks}
