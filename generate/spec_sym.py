"""Symbolic tensors: a shape plus one IR expression for every element.

A `Sym` of shape `(s0, ..., sn)` stands for the tensor whose element at `(i0, ..., in)` is
`expr` with the dim variables `_d0 .. _dn` replaced by the indices. Tracing a spec maps
torch ops onto this algebra, so `arange(S)[:, None] >= arange(S)[None, :]` becomes the
`Sym((S, S), _d0 >= _d1)` and, once the dims are named, `q_idx >= kv_idx`.

Invariants:
- `expr` only uses dim variables `_dk` with `k < len(shape)`, plus free names that are not
  dim variables (`score`, `b`, `h`, ...) and loads of named aux tensors.
- A dim of size 1 may still appear in `expr`; broadcasting substitutes it with 0, so every
  view op here is exact (no approximation of indexing semantics).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import torch

from kb.errors import KBError
from kb.ir.evaluate import eval_expr
from kb.ir.expr import Expr, ExprOp, call, const, free_vars, load, substitute, var, walk

__all__ = ["Sym", "dvar", "scalar_sym", "full", "arange", "load_leaf", "broadcast_to", "broadcast_shapes",
           "binary", "unary", "where", "permute", "unsqueeze", "squeeze", "expand", "view", "slice_", "select",
           "index", "tril", "triu", "reduce", "UNROLL_LIMIT", "NEG_INF_THRESHOLD", "is_neg_inf"]

# Additive fills at or below this value are treated as -inf (masking), e.g. -1e4, -1e9, finfo.min.
NEG_INF_THRESHOLD = -1.0e4


def dvar(k: int) -> Expr:
    return var(f"_d{k}")


@dataclass(frozen=True)
class Sym:
    shape: tuple[int, ...]
    expr: Expr
    dtype: torch.dtype

    @property
    def is_bool(self) -> bool:
        return self.dtype == torch.bool


def scalar_sym(x: int | float | bool) -> Sym:
    dt = torch.bool if isinstance(x, bool) else torch.int64 if isinstance(x, int) else torch.float32
    return Sym((), const(x), dt)


def full(shape: Sequence[int], value: int | float | bool, dtype: torch.dtype) -> Sym:
    if dtype == torch.bool:
        value = bool(value)
    elif dtype.is_floating_point:
        value = float(value)
    else:
        value = int(value)
    return Sym(tuple(shape), const(value), dtype)


def arange(start: int | float, end: int | float, step: int | float, dtype: torch.dtype) -> Sym:
    n = max(0, math.ceil((end - start) / step))
    e: Expr = dvar(0)
    if step != 1:
        e = const(step) * e
    if start != 0:
        e = e + start
    return Sym((n,), e, dtype)


def load_leaf(name: str, t: torch.Tensor) -> Sym:
    return Sym(tuple(t.shape), load(name, *(dvar(k) for k in range(t.dim()))), t.dtype)


def _rename(e: Expr, mapping: dict[int, Expr]) -> Expr:
    return substitute(e, {f"_d{k}": v for k, v in mapping.items()})


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """torch's broadcasting rule, in Python (torch.broadcast_shapes imports sympy on first use, ~0.3 s)."""
    out: list[int] = []
    for dims in itertools.zip_longest(*(reversed(tuple(s)) for s in shapes), fillvalue=1):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise KBError(f"shapes {shapes} do not broadcast: sizes {sorted(sizes)} meet in one dim")
        out.append(sizes.pop() if sizes else 1)
    return tuple(reversed(out))


def broadcast_to(s: Sym, shape: tuple[int, ...]) -> Sym:
    off = len(shape) - len(s.shape)
    mapping = {k: (const(0) if n == 1 and shape[k + off] != 1 else dvar(k + off)) for k, n in enumerate(s.shape)}
    return Sym(shape, _rename(s.expr, mapping), s.dtype)


def _promote(a: Sym, b: Sym, op: ExprOp) -> torch.dtype:
    if op in (ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE, ExprOp.EQ, ExprOp.NE):
        return torch.bool
    if op in (ExprOp.AND, ExprOp.OR) and a.is_bool and b.is_bool:
        return torch.bool  # logical; on integers `&`/`|` are bitwise and promote like arithmetic
    if op is ExprOp.DIV and not (a.dtype.is_floating_point or b.dtype.is_floating_point):
        return torch.float32
    return torch.promote_types(a.dtype, b.dtype)


def binary(op: ExprOp, a: Sym, b: Sym, dtype: torch.dtype | None = None) -> Sym:
    shape = broadcast_shapes(a.shape, b.shape)
    a2, b2 = broadcast_to(a, shape), broadcast_to(b, shape)
    ea, eb = a2.expr, b2.expr
    if op in (ExprOp.ADD, ExprOp.SUB, ExprOp.MUL) and (a.is_bool or b.is_bool):
        ea, eb = _as_number(a2), _as_number(b2)
    return Sym(shape, Expr(op, (ea, eb)), dtype or _promote(a, b, op))


def _as_number(s: Sym) -> Expr:
    return call("where", s.expr, const(1), const(0)) if s.is_bool else s.expr


def unary(op: ExprOp, a: Sym, dtype: torch.dtype | None = None) -> Sym:
    return Sym(a.shape, Expr(op, (a.expr,)), dtype or a.dtype)


def where(c: Sym, x: Sym, y: Sym, dtype: torch.dtype) -> Sym:
    shape = broadcast_shapes(c.shape, x.shape, y.shape)
    args = tuple(broadcast_to(s, shape).expr for s in (c, x, y))
    return Sym(shape, call("where", *args), dtype)


def permute(s: Sym, perm: Sequence[int]) -> Sym:
    n = len(s.shape)
    perm = [p % n for p in perm]
    mapping = {p: dvar(i) for i, p in enumerate(perm)}
    return Sym(tuple(s.shape[p] for p in perm), _rename(s.expr, mapping), s.dtype)


def unsqueeze(s: Sym, dim: int) -> Sym:
    n = len(s.shape) + 1
    dim %= n
    mapping = {k: dvar(k if k < dim else k + 1) for k in range(len(s.shape))}
    return Sym(s.shape[:dim] + (1,) + s.shape[dim:], _rename(s.expr, mapping), s.dtype)


def squeeze(s: Sym, dims: Sequence[int] | None = None) -> Sym:
    n = len(s.shape)
    drop = {d % n for d in dims} if dims is not None else set(range(n))
    drop = {d for d in drop if s.shape[d] == 1}
    mapping: dict[int, Expr] = {}
    j = 0
    for k in range(n):
        if k in drop:
            mapping[k] = const(0)
        else:
            mapping[k] = dvar(j)
            j += 1
    return Sym(tuple(x for k, x in enumerate(s.shape) if k not in drop), _rename(s.expr, mapping), s.dtype)


def expand(s: Sym, sizes: Sequence[int]) -> Sym:
    off = len(sizes) - len(s.shape)
    target = tuple(s.shape[k - off] if (n == -1 and k >= off) else n for k, n in enumerate(sizes))
    return broadcast_to(s, target)


def view(s: Sym, shape: Sequence[int]) -> Sym:
    shape = list(shape)
    numel = math.prod(s.shape)
    if -1 in shape:
        rest = math.prod(x for x in shape if x != -1)
        shape[shape.index(-1)] = numel // rest if rest else 0
    new = tuple(shape)
    if math.prod(new) != numel:
        raise KBError(f"view {s.shape} -> {new} changes the number of elements")
    old_big = [k for k, n in enumerate(s.shape) if n != 1]
    new_big = [k for k, n in enumerate(new) if n != 1]
    if [s.shape[k] for k in old_big] == [new[k] for k in new_big]:
        mapping = {k: const(0) for k, n in enumerate(s.shape) if n == 1}
        mapping.update({o: dvar(nk) for o, nk in zip(old_big, new_big)})
        return Sym(new, _rename(s.expr, mapping), s.dtype)
    # general reshape: through the flat (row-major) index
    flat: Expr = const(0)
    stride = 1
    for k in reversed(range(len(new))):
        if new[k] != 1:
            term = dvar(k) if stride == 1 else dvar(k) * stride
            flat = term if flat == const(0) else term + flat
        stride *= new[k]
    mapping = {}
    stride = 1
    for k in reversed(range(len(s.shape))):
        idx = flat if stride == 1 else flat // stride
        mapping[k] = idx % s.shape[k]
        stride *= s.shape[k]
    return Sym(new, _rename(s.expr, mapping), s.dtype)


def slice_(s: Sym, dim: int, start: int | None, end: int | None, step: int) -> Sym:
    dim %= len(s.shape)
    n = s.shape[dim]
    lo, hi, _ = slice(start, end, step).indices(n)
    size = max(0, math.ceil((hi - lo) / step))
    idx: Expr = dvar(dim) if step == 1 else dvar(dim) * step
    if lo:
        idx = idx + lo
    shape = s.shape[:dim] + (size,) + s.shape[dim + 1:]
    return Sym(shape, _rename(s.expr, {dim: idx}), s.dtype)


def select(s: Sym, dim: int, i: int) -> Sym:
    n = len(s.shape)
    dim %= n
    i %= s.shape[dim]
    mapping = {k: (const(i) if k == dim else dvar(k if k < dim else k - 1)) for k in range(n)}
    return Sym(s.shape[:dim] + s.shape[dim + 1:], _rename(s.expr, mapping), s.dtype)


def index(s: Sym, indices: Sequence[Sym | None], wrap: bool = True,
          known: Mapping[str, torch.Tensor] | None = None) -> Sym:
    """Advanced indexing `s[indices]` (None = full slice), torch/numpy placement rules. Negative indices
    wrap as in torch unless `wrap` is False (an embedding lookup, where torch refuses them) or the index is
    nonnegative wherever it is read: over the dims, with the loads of `known` tensors (sequence ids derived
    from offsets, whatever the offsets) evaluated."""
    given = {k: ix for k, ix in enumerate(indices) if ix is not None}
    present = list(given)
    if not present:
        return s
    bshape = broadcast_shapes(*(ix.shape for ix in given.values()))
    contiguous = present == list(range(present[0], present[-1] + 1))
    first = present[0] if contiguous else 0
    rest = [k for k in range(len(s.shape)) if k not in present]
    nb = len(bshape)
    # output dims: rest dims before `first`, then the broadcast index dims, then the remaining rest dims
    out_pos: dict[int, int] = {}
    pos = 0
    before = [k for k in rest if k < first] if contiguous else []
    after = [k for k in rest if k not in before]
    for k in before:
        out_pos[k] = pos
        pos += 1
    bstart = pos
    pos += nb
    for k in after:
        out_pos[k] = pos
        pos += 1
    mapping: dict[int, Expr] = {k: dvar(p) for k, p in out_pos.items()}
    for k in present:
        ix = broadcast_to(given[k], bshape)
        ix_expr = _rename(ix.expr, {j: dvar(bstart + j) for j in range(nb)})
        n = s.shape[k]
        # negative indices wrap, as in torch
        if wrap and _may_be_negative(ix_expr) and not _nonnegative(ix.expr, bshape, known or {}):
            ix_expr = ix_expr % n
        mapping[k] = ix_expr
    shape = tuple(s.shape[k] for k in before) + bshape + tuple(s.shape[k] for k in after)
    return Sym(shape, _rename(s.expr, mapping), s.dtype)


def _nonnegative(e: Expr, shape: tuple[int, ...], known: Mapping[str, torch.Tensor]) -> bool:
    """True if `e` (over dim vars and loads of `known` only) is >= 0 everywhere on `shape`."""
    if not free_vars(e) <= {f"_d{k}" for k in range(len(shape))}:
        return False
    if any(n.op is ExprOp.LOAD and n.value not in known for n in walk(e)):
        return False
    env = {f"_d{k}": torch.arange(n).view([n if j == k else 1 for j in range(len(shape))]) for k, n in enumerate(shape)}
    try:
        return bool((torch.as_tensor(eval_expr(e, env, dict(known))) >= 0).all())
    except Exception:
        return False


def _may_be_negative(e: Expr) -> bool:
    return any(n.op in (ExprOp.SUB, ExprOp.NEG) or (n.op is ExprOp.CONST and isinstance(n.value, (int, float)) and n.value < 0)
               for n in walk(e))


UNROLL_LIMIT = 64  # elements a reduction (torch.any/all/sum/dot) may combine: each becomes a term of the expression


def reduce(s: Sym, dims: Sequence[int] | None, op: ExprOp, keepdim: bool, dtype: torch.dtype) -> Sym:
    """`s` reduced over `dims` (None: all) by the binary `op` (OR: any, AND: all, ADD: sum), unrolled: the
    result is one term per reduced element, folded to the left. An empty reduction is op's unit."""
    n = len(s.shape)
    red = sorted({d % n for d in dims} if dims is not None else range(n))
    count = math.prod(s.shape[d] for d in red)
    if count > UNROLL_LIMIT:
        raise KBError(f"a reduction over {count} elements (more than {UNROLL_LIMIT} are not unrolled into the expression)")
    kept = [k for k in range(n) if k not in red]
    rename = {k: dvar(k if keepdim else kept.index(k)) for k in kept}
    terms = [_rename(s.expr, rename | {d: const(i) for d, i in zip(red, combo)})
             for combo in itertools.product(*(range(s.shape[d]) for d in red))]
    unit = {ExprOp.OR: const(False), ExprOp.AND: const(True)}.get(op, const(0))
    expr = terms[0] if terms else unit
    for t in terms[1:]:
        expr = Expr(op, (expr, t))
    shape = tuple(1 if k in red else m for k, m in enumerate(s.shape)) if keepdim else tuple(s.shape[k] for k in kept)
    return Sym(shape, expr, dtype)


def tril(s: Sym, diagonal: int = 0) -> Sym:
    i, j = dvar(len(s.shape) - 2), dvar(len(s.shape) - 1)
    cond = j <= (i if diagonal == 0 else i + diagonal)
    return Sym(s.shape, call("where", cond, s.expr, const(_zero(s.dtype))), s.dtype)


def triu(s: Sym, diagonal: int = 0) -> Sym:
    i, j = dvar(len(s.shape) - 2), dvar(len(s.shape) - 1)
    cond = j >= (i if diagonal == 0 else i + diagonal)

    return Sym(s.shape, call("where", cond, s.expr, const(_zero(s.dtype))), s.dtype)


def _zero(dtype: torch.dtype) -> int | float | bool:
    return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0


# ---------------------------------------------------------------- -inf fills


def is_neg_inf(e: Expr) -> bool:
    return e.op is ExprOp.CONST and isinstance(e.value, float) and e.value <= NEG_INF_THRESHOLD


def uses_only(e: Expr, names: set[str]) -> bool:
    return free_vars(e) <= names


def with_expr(s: Sym, e: Expr) -> Sym:
    return replace(s, expr=e)
