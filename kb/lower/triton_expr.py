"""IR expressions -> Python source text, for Triton device code or for the host wrapper.

Two targets share one walker (`ExprTarget`):
- DEVICE: Triton code inside a `@triton.jit` function. `//` and `%` keep floor semantics:
  when both operands are provably non-negative they lower to Triton's own `//`/`%` (which
  truncate, identical there); otherwise to the generated helpers `_floordiv`/`_floormod`.
  `tanh` lowers to `_tanh` (2*sigmoid(2x)-1: no libdevice, works in the interpreter).
  `trunc(x)` of a float lowers to `x.to(tl.int32)` (a conversion toward zero, negative values
  included); the kernel's integers are int32 index math, so a float beyond int32 range has no
  defined trunc there (torch's int64 would hold it; such a value indexes no aux tensor anyway).
  Aux loads lower to masked `tl.load`s: out-of-range indices read 0 (the IR's rule).
- HOST: plain Python over ints/floats/torch tensors, using the module's `_h*` helpers
  (Python's `//`, `%` are already floor ops, on ints and on torch tensors; `_htrunc` is int64).

Invariants: every binary operation is parenthesised (the output never depends on
precedence); every variable is looked up in `ExprContext.names` (unknown names raise
`KBError`), so the lowering never emits a name it was not given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

from kb.errors import KBError
from kb.ir.expr import Expr, ExprOp
from kb.ir.nodes import Dtype

__all__ = ["ExprTarget", "Kind", "DTYPE_KIND", "Sym", "AuxRef", "ExprContext", "lower_expr", "expr_kind", "is_nonneg"]


class ExprTarget(Enum):
    DEVICE = "device"
    HOST = "host"


class Kind(Enum):
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"


DTYPE_KIND = {Dtype.F32: Kind.FLOAT, Dtype.BF16: Kind.FLOAT, Dtype.F16: Kind.FLOAT,
              Dtype.I32: Kind.INT, Dtype.I64: Kind.INT, Dtype.BOOL: Kind.BOOL}  # the value kind of a tensor element


@dataclass(frozen=True)
class Sym:
    """What a name lowers to: its code, value kind, whether it is known to be >= 0, and the size code it
    is known to stay below (a launch-grid axis is below its extent), so loads need no guard there."""

    code: str
    kind: Kind
    nonneg: bool = False
    below: str | None = None


@dataclass(frozen=True)
class AuxRef:
    """A tensor that expressions may index: pointer/strides/sizes as code (DEVICE) or the tensor (HOST)."""

    code: str  # DEVICE: the pointer argument; HOST: the tensor variable
    strides: tuple[str, ...]
    sizes: tuple[str, ...]
    kind: Kind


@dataclass(frozen=True)
class ExprContext:
    target: ExprTarget
    names: Mapping[str, Sym]
    aux: Mapping[str, AuxRef] = field(default_factory=dict)


_CMP = {ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE, ExprOp.EQ, ExprOp.NE}
_ARITH = {ExprOp.ADD, ExprOp.SUB, ExprOp.MUL}
_FLOAT_CALLS = {ExprOp.EXP, ExprOp.EXP2, ExprOp.LOG, ExprOp.TANH, ExprOp.SIGMOID, ExprOp.SQRT}
_DEVICE_CALL = {
    ExprOp.EXP: "tl.exp", ExprOp.EXP2: "tl.exp2", ExprOp.LOG: "tl.log", ExprOp.TANH: "_tanh",
    ExprOp.SIGMOID: "tl.sigmoid", ExprOp.SQRT: "tl.sqrt", ExprOp.ABS: "tl.abs",
    ExprOp.MAXIMUM: "tl.maximum", ExprOp.MINIMUM: "tl.minimum", ExprOp.CDIV: "tl.cdiv", ExprOp.WHERE: "tl.where",
}
_HOST_CALL = {op: "_h" + op.value for op in _DEVICE_CALL}


def _sym(e: Expr, ctx: ExprContext) -> Sym:
    try:
        return ctx.names[str(e.value)]
    except KeyError:
        raise KBError(f"expression uses {e.value!r}, which is not visible here; "
                      f"visible names: {', '.join(sorted(ctx.names))}") from None


def expr_kind(e: Expr, ctx: ExprContext) -> Kind:
    """The value kind of `e` (int / float / bool), Python-style promotion."""
    op = e.op
    if op is ExprOp.CONST:
        return Kind.BOOL if isinstance(e.value, bool) else Kind.INT if isinstance(e.value, int) else Kind.FLOAT
    if op is ExprOp.VAR:
        return _sym(e, ctx).kind
    if op is ExprOp.LOAD:
        return _aux(e, ctx).kind
    if op in _CMP or op in (ExprOp.AND, ExprOp.OR, ExprOp.NOT):
        return Kind.BOOL
    if op is ExprOp.TRUNC:
        return Kind.INT
    if op in _FLOAT_CALLS or op is ExprOp.DIV:
        return Kind.FLOAT
    kinds = [expr_kind(a, ctx) for a in (e.args[1:] if op is ExprOp.WHERE else e.args)]
    return Kind.FLOAT if Kind.FLOAT in kinds else Kind.INT


def is_nonneg(e: Expr, ctx: ExprContext) -> bool:
    """Conservative proof that an integer expression is >= 0."""
    op = e.op
    if op is ExprOp.CONST:
        return not isinstance(e.value, bool) and e.value >= 0  # type: ignore[operator]
    if op is ExprOp.VAR:
        return _sym(e, ctx).nonneg
    if op in (ExprOp.ADD, ExprOp.MUL, ExprOp.FLOORDIV, ExprOp.CDIV, ExprOp.MINIMUM):
        return all(is_nonneg(a, ctx) for a in e.args)
    if op is ExprOp.MOD:
        return is_nonneg(e.args[1], ctx)  # floor modulo takes the divisor's sign
    if op is ExprOp.MAXIMUM:
        return any(is_nonneg(a, ctx) for a in e.args)
    if op in (ExprOp.ABS, ExprOp.EXP, ExprOp.EXP2, ExprOp.SQRT, ExprOp.SIGMOID):
        return True
    if op is ExprOp.TRUNC:
        return is_nonneg(e.args[0], ctx)  # toward zero: a float in (-1, 0) gives 0, never below
    return False


def _aux(e: Expr, ctx: ExprContext) -> AuxRef:
    try:
        ref = ctx.aux[str(e.value)]
    except KeyError:
        raise KBError(f"expression {e} loads from {e.value!r}, which is not an aux tensor of the program; "
                      f"declare it as `param {e.value}: [...] <dtype> aux`") from None
    if len(e.args) != len(ref.sizes):
        raise KBError(f"expression {e}: {e.value} has {len(ref.sizes)} dims, indexed with {len(e.args)}")
    return ref


def _const(v: object, target: ExprTarget) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        if math.isinf(v):
            return 'float("inf")' if v > 0 else 'float("-inf")'
        return repr(v)
    return str(v)


def lower_expr(e: Expr, ctx: ExprContext) -> str:
    """Python source text computing `e` on `ctx.target`."""
    op, dev = e.op, ctx.target is ExprTarget.DEVICE
    if op is ExprOp.CONST:
        return _const(e.value, ctx.target)
    if op is ExprOp.VAR:
        return _sym(e, ctx).code
    if op is ExprOp.LOAD:
        return _lower_load(e, ctx)
    args = [lower_expr(a, ctx) for a in e.args]
    if op is ExprOp.NEG:
        return f"(-{args[0]})"
    if op is ExprOp.NOT:
        return f"({args[0]} == 0)" if dev else f"_hnot({args[0]})"
    if op in (ExprOp.FLOORDIV, ExprOp.MOD):
        if not dev or all(is_nonneg(a, ctx) for a in e.args):
            return f"({args[0]} {op.value} {args[1]})"
        return f"{'_floordiv' if op is ExprOp.FLOORDIV else '_floormod'}({args[0]}, {args[1]})"
    if op in _ARITH or op in _CMP or op in (ExprOp.DIV, ExprOp.AND, ExprOp.OR):
        return f"({args[0]} {op.value} {args[1]})"
    if op is ExprOp.TRUNC:
        if e.args[0].op is ExprOp.CONST and not isinstance(e.args[0].value, bool):
            return str(math.trunc(e.args[0].value))  # type: ignore[arg-type]
        return _lower_trunc(args[0], expr_kind(e.args[0], ctx), dev)
    if op in _FLOAT_CALLS and dev and expr_kind(e.args[0], ctx) is not Kind.FLOAT:
        args[0] = f"({args[0]}).to(tl.float32)"
    return f"{(_DEVICE_CALL if dev else _HOST_CALL)[op]}({', '.join(args)})"


def _lower_trunc(code: str, kind: Kind, dev: bool) -> str:
    """An integer operand is already truncated; a float or bool one converts (toward zero)."""
    if kind is Kind.INT:
        return code
    return f"({code}).to(tl.int32)" if dev else f"_htrunc({code})"


def _lower_load(e: Expr, ctx: ExprContext) -> str:
    ref = _aux(e, ctx)
    idx = [lower_expr(a, ctx) for a in e.args]
    if ctx.target is ExprTarget.HOST:
        return f"_hload({ref.code}, ({', '.join(idx)},))"
    offset = " + ".join(f"{i} * {s}" for i, s in zip(idx, ref.strides))
    guards = []
    for a, i, size in zip(e.args, idx, ref.sizes):
        if a.op is ExprOp.VAR and _sym(a, ctx).below == size:
            continue  # a grid index below this size by construction (forward() checks the aux shape)
        if not is_nonneg(a, ctx):
            guards.append(f"({i} >= 0)")
        guards.append(f"({i} < {size})")
    ptr = f"{ref.code} + {offset}"
    return f"tl.load({ptr}, mask={' & '.join(guards)}, other=0)" if guards else f"tl.load({ptr})"
