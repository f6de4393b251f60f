"""What both lowerings know about an IR expression before spelling it: the names it may use and its value kinds.

`ExprContext` maps every visible IR name to a `Sym` (its code, value kind, what is known of its range) and every
aux tensor to an `AuxRef`; `expr_kind` types an expression (Python-style promotion) and `is_nonneg` proves
integer expressions >= 0. The Triton (`kb.lower.triton_expr`) and CUDA (`kb.lower.cuda_expr`) spellings share
them, so both lowerings type an expression the same way; only the text differs.

Invariant: every variable and aux tensor is looked up through `lookup` / `aux_ref`, which raise `KBError`
for names that are not visible, so no lowering ever emits a name it was not given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Mapping

from kb.errors import KBError
from kb.ir.expr import Expr, ExprOp, number

from kb.ir.nodes import SCHEDULE_CONSTANTS, Dtype, Param

__all__ = ["ExprTarget", "Kind", "DTYPE_KIND", "Sym", "AuxRef", "ExprContext", "visible_names", "CMP_OPS", "FLOAT_CALLS", "BITWISE_OPS", "lookup",
           "aux_ref", "expr_kind", "is_bitwise", "is_nonneg", "index_guards", "index_guards_by_position"]


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


CMP_OPS = {ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE, ExprOp.EQ, ExprOp.NE}
FLOAT_CALLS = {ExprOp.EXP, ExprOp.EXP2, ExprOp.LOG, ExprOp.TANH, ExprOp.SIGMOID, ExprOp.SQRT, ExprOp.ERF}
BITWISE_OPS = {ExprOp.AND, ExprOp.OR, ExprOp.NOT}  # logical on booleans, bitwise on integers (Python's rule)


def visible_names(dims: Iterable[str], scalars: Iterable[Param], local: Callable[[str], str] = str) -> dict[str, Sym]:
    """What every kernel or host expression sees from the start: the dims and schedule constants (non-negative
    ints) and the scalar params; `local` spells a dim or scalar as the generated code names it."""
    names = {d: Sym(local(d), Kind.INT, True) for d in dims}
    names.update({c: Sym(c, Kind.INT, True) for c in SCHEDULE_CONSTANTS})
    names.update({q.name: Sym(local(q.name), DTYPE_KIND[q.dtype]) for q in scalars})
    return names


def lookup(e: Expr, ctx: ExprContext) -> Sym:
    """The symbol of variable `e`; KBError naming what is visible when it is not."""
    try:
        return ctx.names[str(e.value)]
    except KeyError:
        raise KBError(f"expression uses {e.value!r}, which is not visible here; "
                      f"visible names: {', '.join(sorted(ctx.names))}") from None


def aux_ref(e: Expr, ctx: ExprContext) -> AuxRef:
    """The tensor load `e` reads; KBError when it is not an aux tensor or is indexed with the wrong arity."""
    try:
        ref = ctx.aux[str(e.value)]
    except KeyError:
        raise KBError(f"expression {e} loads from {e.value!r}, which is not an aux tensor of the program; "
                      f"declare it as `param {e.value}: [...] <dtype> aux`") from None
    if len(e.args) != len(ref.sizes):
        raise KBError(f"expression {e}: {e.value} has {len(ref.sizes)} dims, indexed with {len(e.args)}")
    return ref


def expr_kind(e: Expr, ctx: ExprContext) -> Kind:
    """The value kind of `e` (int / float / bool), Python-style promotion."""
    op = e.op
    if op is ExprOp.CONST:
        return Kind.BOOL if isinstance(e.value, bool) else Kind.INT if isinstance(e.value, int) else Kind.FLOAT
    if op is ExprOp.VAR:
        return lookup(e, ctx).kind
    if op is ExprOp.LOAD:
        return aux_ref(e, ctx).kind
    if op in CMP_OPS:
        return Kind.BOOL
    if op in BITWISE_OPS:
        return Kind.INT if is_bitwise(e, ctx) else Kind.BOOL
    if op in (ExprOp.TRUNC, ExprOp.SHL, ExprOp.SHR):
        return Kind.INT
    if op in FLOAT_CALLS or op is ExprOp.DIV:
        return Kind.FLOAT
    kinds = [expr_kind(a, ctx) for a in (e.args[1:] if op is ExprOp.WHERE else e.args)]
    return Kind.FLOAT if Kind.FLOAT in kinds else Kind.INT


def is_bitwise(e: Expr, ctx: ExprContext) -> bool:
    """Is `&`/`|`/`~` node `e` bitwise (an integer operand and no float one; True & 3 == 1) rather than logical?"""
    kinds = [expr_kind(a, ctx) for a in e.args]
    return Kind.INT in kinds and Kind.FLOAT not in kinds


def is_nonneg(e: Expr, ctx: ExprContext) -> bool:
    """Conservative proof that an integer expression is >= 0."""
    op = e.op
    if op is ExprOp.CONST:
        return not isinstance(e.value, bool) and number(e) >= 0

    if op is ExprOp.VAR:
        return lookup(e, ctx).nonneg
    if op in (ExprOp.ADD, ExprOp.MUL, ExprOp.FLOORDIV, ExprOp.CDIV, ExprOp.MINIMUM):
        return all(is_nonneg(a, ctx) for a in e.args)
    if op is ExprOp.MOD:
        return is_nonneg(e.args[1], ctx)  # floor modulo takes the divisor's sign
    if op is ExprOp.SHR:
        return is_nonneg(e.args[0], ctx)
    if op is ExprOp.AND:  # bitwise: a non-negative operand clears the sign bit (a logical AND is never asked)
        return any(is_nonneg(a, ctx) for a in e.args)
    if op is ExprOp.OR:
        return all(is_nonneg(a, ctx) for a in e.args)
    if op is ExprOp.MAXIMUM:
        return any(is_nonneg(a, ctx) for a in e.args)
    if op in (ExprOp.ABS, ExprOp.EXP, ExprOp.EXP2, ExprOp.SQRT, ExprOp.SIGMOID):
        return True
    if op is ExprOp.TRUNC:
        return is_nonneg(e.args[0], ctx)  # toward zero: a float in (-1, 0) gives 0, never below
    return False


def index_guards(load: Expr, idx: list[str], ctx: ExprContext, zero: str) -> list[str]:
    """The in-range tests of aux load `load` whose indices lower to `idx` (`zero`: the target's 0 literal): `i >= 0`
    unless proven, `i < size` unless the index is a name known to stay below that size (a grid axis)."""
    return [g for per_index in index_guards_by_position(load, idx, ctx, zero) for g in per_index]


def index_guards_by_position(load: Expr, idx: list[str], ctx: ExprContext, zero: str) -> list[list[str]]:
    """`index_guards`, one list per index of the load."""
    guards: list[list[str]] = []
    for a, i, size in zip(load.args, idx, aux_ref(load, ctx).sizes):
        guards.append([])
        if a.op is ExprOp.VAR and lookup(a, ctx).below == size:
            continue  # a grid index below this size by construction (the host checks the aux shape)
        if not is_nonneg(a, ctx):
            guards[-1].append(f"({i} >= {zero})")
        guards[-1].append(f"({i} < {size})")
    return guards
