"""IR expressions -> Python source text, for Triton device code or for the host wrapper.

Two targets share one walker (`ExprTarget`):
- DEVICE: Triton code inside a `@triton.jit` function. `//` and `%` keep floor semantics:
  when both operands are provably non-negative they lower to Triton's own `//`/`%` (which
  truncate, identical there); otherwise to the generated helpers `_floordiv`/`_floormod`.
  `tanh` lowers to `_tanh` (PTX tanh.approx.f32 on a GPU; 2*sigmoid(2x)-1 under the interpreter), `erf` to `tl.erf`.
  `&`, `|` are Triton's own (logical on int1, bitwise on integers, as in the IR); `~` of a boolean is
  `(x == 0)`, of an integer `~x`; `<<`, `>>` are Triton's shifts (`>>` of a signed integer is arithmetic).
  Integers are int32 there, so a shift past bit 31 wraps as FlexAttention's int32 indices do.
  `trunc(x)` of a float lowers to `x.to(tl.int32)` (a conversion toward zero, negative values
  included); the kernel's integers are int32 index math, so a float beyond int32 range has no
  defined trunc there (torch's int64 would hold it; such a value indexes no aux tensor anyway).
  Aux loads lower to masked `tl.load`s: out-of-range indices read 0 (the IR's rule); in a tile load, the
  in-range tests of constant indices (`t[q_idx, 0]`'s `0 < t_n1`) gate the others through `tl.where` (the
  interpreter refuses a tile `&` scalar mask).
- HOST: plain Python over ints/floats/torch tensors, using the module's `_h*` helpers
  (Python's `//`, `%` are already floor ops, on ints and on torch tensors; `_htrunc` is int64; `erf` is
  `_hfloat(torch.erf)`).

Invariants: every binary operation is parenthesised (the output never depends on
precedence); every name is looked up in the `kb.lower.expr_context.ExprContext` (unknown names
raise `KBError`), so the lowering never emits a name it was not given.
"""

from __future__ import annotations

import math

from kb.ir.expr import Expr, ExprOp, free_vars, loaded_tensors, number

from kb.lower.expr_context import (
    CMP_OPS, FLOAT_CALLS, ExprContext, ExprTarget, Kind, aux_ref, expr_kind, index_guards_by_position, is_bitwise,
    is_nonneg, lookup,
)

__all__ = ["lower_expr"]

_ARITH = {ExprOp.ADD, ExprOp.SUB, ExprOp.MUL}
_TILE_NAMES = frozenset({"q_idx", "kv_idx", "score"})  # variant names that lower to tiles (the rest are scalars)
_DEVICE_CALL = {
    ExprOp.EXP: "tl.exp", ExprOp.EXP2: "tl.exp2", ExprOp.LOG: "tl.log", ExprOp.TANH: "_tanh",
    ExprOp.SIGMOID: "tl.sigmoid", ExprOp.SQRT: "tl.sqrt", ExprOp.ABS: "tl.abs",
    ExprOp.MAXIMUM: "tl.maximum", ExprOp.MINIMUM: "tl.minimum", ExprOp.CDIV: "tl.cdiv", ExprOp.WHERE: "tl.where",
    ExprOp.ERF: "tl.erf",
}
_HOST_CALL = {op: "_h" + op.value for op in _DEVICE_CALL} | {ExprOp.ERF: "_hfloat(torch.erf)"}


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
        return lookup(e, ctx).code
    if op is ExprOp.LOAD:
        return _lower_load(e, ctx)
    args = [lower_expr(a, ctx) for a in e.args]
    if op is ExprOp.NEG:
        return f"(-{args[0]})"
    if op is ExprOp.NOT:
        if is_bitwise(e, ctx):
            return f"(~{args[0]})"
        return f"({args[0]} == 0)" if dev else f"_hnot({args[0]})"
    if op in (ExprOp.FLOORDIV, ExprOp.MOD):
        if not dev or all(is_nonneg(a, ctx) for a in e.args):
            return f"({args[0]} {op.value} {args[1]})"
        return f"{'_floordiv' if op is ExprOp.FLOORDIV else '_floormod'}({args[0]}, {args[1]})"
    if op in _ARITH or op in CMP_OPS or op in (ExprOp.DIV, ExprOp.AND, ExprOp.OR, ExprOp.SHL, ExprOp.SHR):
        return f"({args[0]} {op.value} {args[1]})"
    if op is ExprOp.TRUNC:
        if e.args[0].op is ExprOp.CONST and not isinstance(e.args[0].value, bool):
            return str(math.trunc(number(e.args[0])))

        return _lower_trunc(args[0], expr_kind(e.args[0], ctx), dev)
    if op in FLOAT_CALLS and dev and expr_kind(e.args[0], ctx) is not Kind.FLOAT:
        args[0] = f"({args[0]}).to(tl.float32)"
    return f"{(_DEVICE_CALL if dev else _HOST_CALL)[op]}({', '.join(args)})"


def _lower_trunc(code: str, kind: Kind, dev: bool) -> str:
    """An integer operand is already truncated; a float or bool one converts (toward zero)."""
    if kind is Kind.INT:
        return code
    return f"({code}).to(tl.int32)" if dev else f"_htrunc({code})"


def _lower_load(e: Expr, ctx: ExprContext) -> str:
    ref = aux_ref(e, ctx)
    idx = [lower_expr(a, ctx) for a in e.args]
    if ctx.target is ExprTarget.HOST:
        return f"_hload({ref.code}, ({', '.join(idx)},))"
    offset = " + ".join(f"{i} * {s}" for i, s in zip(idx, ref.strides))
    ptr = f"{ref.code} + {offset}"
    tile: list[str] = []
    fixed: list[str] = []
    for a, guards in zip(e.args, index_guards_by_position(e, idx, ctx, "0")):
        (fixed if not free_vars(a) and not loaded_tensors(a) else tile).extend(guards)
    if fixed and any(free_vars(a) & _TILE_NAMES for a in e.args):
        # a tile of conditions `&` a scalar one gives int32, not int1, under the Triton interpreter, which then
        # refuses it as a load mask ("mask has unsupported dtype"): the constant indices' tests select the rest
        return f"tl.load({ptr}, mask=tl.where({' & '.join(fixed)}, {' & '.join(tile) or 'True'}, False), other=0)"
    guards = tile + fixed
    return f"tl.load({ptr}, mask={' & '.join(guards)}, other=0)" if guards else f"tl.load({ptr})"
