"""What the Triton kernel generator fuses, decided from the IR before it spells a line.

Two rewrites of a statement pair, planned per kernel (`plan_fusions`) and only spelled by kb.lower.triton_kernel:
- **scale folding**: `elementwise t = t * c` (c a float scalar) whose `t` is then only masked and fed to
  `online_softmax` is folded into the softmax's exp2 multiplier when c > 0 at run time (the POS_c constexpr), as
  FlashAttention folds sm_scale * log2(e) into one FMA;
- **dot accumulation** (backward kernels): `dot t = a @ b` followed by `elementwise X = X + t`, X an fp32
  accumulator (an f32 `init`) and t read nowhere else, becomes `X = tl.dot(a, b, X)`.

A decision is keyed by the body (the statement tuple, by identity) and the statement's index in it: it depends on
the statements after it, so equal statements in different places may be decided differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kb.ir.expr import Expr, ExprOp, free_vars
from kb.ir.nodes import (
    Dot, Dtype, Elementwise, For, Gather, IfBlock, Init, Kernel, Mask, OnlineSoftmax, Probs, SoftmaxGrad, AuxGrad, Span,
    Stmt, TileAt, walk_stmts,
)

__all__ = ["FusionPlan", "plan_fusions", "reads"]


def reads(st: Stmt) -> set[str]:
    """Names (tiles and scalars) a statement reads, nested bodies included."""
    if isinstance(st, (For, IfBlock)):
        out = set().union(*(reads(x) for x in walk_stmts(st.body if isinstance(st, For) else st.then + st.orelse)))
        return out | (free_vars(st.lo) | free_vars(st.hi) if isinstance(st, For) else set())
    names: set[str] = set()
    for f in st.__dataclass_fields__:
        val = getattr(st, f)
        if isinstance(val, Expr):
            names |= free_vars(val)
        elif isinstance(val, TileAt):
            names |= {n for x in val for n in free_vars(x)}
        elif isinstance(val, tuple):
            names |= {n for x in val if isinstance(x, Expr) for n in free_vars(x)}
            names |= {n for x in val if isinstance(x, Span) for n in free_vars(x.start)}
            names |= {n for x in val if isinstance(x, Span) and x.until is not None for n in free_vars(x.until)}
            names |= {n for x in val if isinstance(x, Gather) for e in (x.index, x.valid) if e is not None
                      for n in free_vars(e) - {x.var}}
    for f in ("a", "b", "src", "tile", "m", "l", "acc", "scores", "values", "value", "o_parts", "lse_parts"):
        val = getattr(st, f, None)
        if isinstance(val, str):
            names.add(val)
    names.update(v for f in _BACKWARD_READS.get(type(st), ()) if (v := getattr(st, f)) is not None)
    return names


# tile operands of backward statements not covered by the shared field names above (Finalize's `lse` is an output)
_BACKWARD_READS: dict[type, tuple[str, ...]] = {Probs: ("lse",), SoftmaxGrad: ("p", "dp", "delta"), AuxGrad: ("lse",)}


@dataclass(frozen=True)
class FusionPlan:
    folds: dict[tuple[int, int], str] = field(default_factory=dict)  # (id(body), i) of `t = t * c` -> c
    accumulates: dict[tuple[int, int], str] = field(default_factory=dict)  # (id(body), i) of `dot t` -> X

    def fold(self, body: tuple[Stmt, ...], i: int) -> str | None:
        return self.folds.get((id(body), i))

    def accumulator(self, body: tuple[Stmt, ...], i: int) -> str | None:
        return self.accumulates.get((id(body), i))


def _fold_target(st: Stmt, rest: tuple[Stmt, ...], scalars: set[str]) -> str | None:
    """The scalar c when `st` is `t = t * c` and `t` is then only masked and fed to online_softmax."""
    if not isinstance(st, Elementwise) or st.value.op is not ExprOp.MUL:
        return None
    x, y = st.value.args
    if y.op is ExprOp.VAR and y.value == st.out:
        x, y = y, x
    if not (x.op is ExprOp.VAR and x.value == st.out and y.op is ExprOp.VAR and y.value in scalars):
        return None
    t = st.out
    for nxt in rest:
        for sub in walk_stmts((nxt,)):
            if isinstance(sub, IfBlock) or (isinstance(sub, Mask) and sub.tile == t):
                continue
            if isinstance(sub, OnlineSoftmax) and sub.scores == t:
                return str(y.value) if not any(t in reads(r) for r in rest[rest.index(nxt) + 1:]) else None
            if t in reads(sub) or getattr(sub, "out", None) == t:
                return None
    return None


def _accumulator(k: Kernel, st: Stmt, rest: tuple[Stmt, ...], f32_accumulators: set[str]) -> str | None:
    """X when `st` is `dot t = ...` followed by `elementwise X = X + t` (or `t + X`), X an f32 accumulator and t
    read nowhere else."""
    if not isinstance(st, Dot) or not rest or not isinstance(rest[0], Elementwise) or rest[0].value.op is not ExprOp.ADD:
        return None
    acc, t = rest[0].out, st.out
    if sorted(str(x.value) for x in rest[0].value.args if x.op is ExprOp.VAR) != sorted((acc, t)) or acc == t \
            or acc in (st.a, st.b) or acc not in f32_accumulators:
        return None
    readers = [x for x in walk_stmts(k.body) if not isinstance(x, (For, IfBlock)) and t in reads(x)]
    return acc if readers == [rest[0]] else None


def _bodies(body: tuple[Stmt, ...]) -> list[tuple[Stmt, ...]]:
    out = [body]
    for st in body:
        if isinstance(st, For):
            out += _bodies(st.body)
        elif isinstance(st, IfBlock):
            out += _bodies(st.then) + _bodies(st.orelse)
    return out


def plan_fusions(k: Kernel, float_scalars: set[str], *, fold_scale: bool, accumulate: bool) -> FusionPlan:
    """The scale folds (when `fold_scale`) and dot accumulations (when `accumulate`) of kernel `k`."""
    f32 = {st.out for st in walk_stmts(k.body) if isinstance(st, Init) and st.dtype is Dtype.F32}
    plan = FusionPlan()
    for body in _bodies(k.body):
        for i, st in enumerate(body):
            c = _fold_target(st, body[i + 1:], float_scalars) if fold_scale else None
            if c is not None:
                plan.folds[(id(body), i)] = c
            acc = _accumulator(k, st, body[i + 1:], f32) if accumulate else None
            if acc is not None:
                plan.accumulates[(id(body), i)] = acc
    return plan
