"""IR expressions -> CUDA C++ expression text (device and host code alike).

The names, value kinds and non-negativity proofs are the shared `kb.lower.expr_context`'s, as for
the Triton spelling (`kb.lower.triton_expr`), so both lowerings type an expression the same way; only
the spelling differs. `ExprContext.target` is ignored here: the generated helpers are `__host__ __device__`.

C++ types: INT is `long long`, FLOAT is `float`, BOOL is `bool`.

Invariants:
- Every binary operation is parenthesised (the output never depends on C++ precedence).
- `//` and `%` keep Python's floor semantics: plain `/` and `%` only when both operands are
  provably non-negative integers, else `kb_floordiv`/`kb_floormod` (ints) or `floorf` forms
  (floats). `/` is always true division in float.
- `maximum`/`minimum`/`where` cast both value operands to the result kind, so C++ overload
  resolution never sees mixed types.
- Aux loads (`t[i, j]`) read `ptr[i*s0 + j*s1]` only when every index is in range, else 0
  (the IR's load rule); element types convert through the `kb_f` overloads.
- `trunc(x)` of a float is the C++ conversion `(long long)(x)`, which truncates toward zero.
- `&`, `|`, `~` are `&&`, `||`, `!` on booleans and the bitwise `&`, `|`, `~` on integers (a boolean operand
  converted to 0/1); `<<`, `>>` shift integers (`>>` of a signed value is arithmetic, as in Python). `erf` is
  `erff`.
- Unknown names raise `KBError` (from `expr_context`), so nothing unbound is ever emitted.

32-bit integers (`IntWidth`, optional): a caller that can prove value ranges (kb.lower.cuda_mma's
score-fragment loops) passes `IntWidth`, and every INT node it marks narrow is computed in `int`
(literals without `LL`, `kb_*32` helpers); a node is only narrow when its INT operands are too, so
no `int` operation sees a value that was truncated. Wide nodes widen narrow operands explicitly
(`(long long)`), so overloads and promotions never mix the two widths.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Callable

from kb.ir.expr import Expr, ExprOp
from kb.lower.expr_context import (
    CMP_OPS, ExprContext, Kind, aux_ref, expr_kind, index_guards, is_bitwise, is_nonneg, lookup,
)

__all__ = ["lower_cexpr", "cxx_type", "float_literal", "EXPR_HELPERS", "IntWidth"]

_CXX_TYPE = {Kind.INT: "long long", Kind.FLOAT: "float", Kind.BOOL: "bool"}
_FLOAT_FN = {ExprOp.EXP: "expf", ExprOp.EXP2: "exp2f", ExprOp.LOG: "logf", ExprOp.TANH: "kb_tanh",
             ExprOp.SIGMOID: "kb_sigmoid", ExprOp.SQRT: "sqrtf", ExprOp.ERF: "erff"}

# Device/host helpers the lowered expressions call; part of every generated source's preamble.
EXPR_HELPERS = r"""
#define KB_HD __host__ __device__ __forceinline__
KB_HD long long kb_floordiv(long long a, long long b) {
  long long q = a / b;
  return ((a % b != 0) && ((a < 0) != (b < 0))) ? q - 1 : q;
}
KB_HD long long kb_floormod(long long a, long long b) {
  long long r = a % b;
  return ((r != 0) && ((r < 0) != (b < 0))) ? r + b : r;
}
// 32-bit versions for index math proven to fit (kb.lower.cuda_mma's fragment loops); own names, never overloads
KB_HD int kb_floordiv32(int a, int b) {
  int q = a / b;
  return ((a % b != 0) && ((a < 0) != (b < 0))) ? q - 1 : q;
}
KB_HD int kb_floormod32(int a, int b) {
  int r = a % b;
  return ((r != 0) && ((r < 0) != (b < 0))) ? r + b : r;
}
KB_HD int kb_cdiv32(int a, int b) { return -kb_floordiv32(-a, b); }
KB_HD int kb_max32(int a, int b) { return a > b ? a : b; }
KB_HD int kb_min32(int a, int b) { return a < b ? a : b; }
KB_HD int kb_abs32(int x) { return x < 0 ? -x : x; }
KB_HD float kb_floordivf(float a, float b) { return floorf(a / b); }
KB_HD float kb_floormodf(float a, float b) { return a - b * floorf(a / b); }
KB_HD long long kb_cdiv(long long a, long long b) { return -kb_floordiv(-a, b); }
KB_HD long long kb_max(long long a, long long b) { return a > b ? a : b; }
KB_HD long long kb_min(long long a, long long b) { return a < b ? a : b; }
KB_HD float kb_max(float a, float b) { return fmaxf(a, b); }
KB_HD float kb_min(float a, float b) { return fminf(a, b); }
KB_HD float kb_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// one MUFU op on the GPU (max relative error 2^-10.99), as FlashAttention-3's softcap; tanhf is a long polynomial
KB_HD float kb_tanh(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return tanhf(x);
#endif
}
KB_HD long long kb_abs(long long x) { return x < 0 ? -x : x; }
KB_HD float kb_abs(float x) { return fabsf(x); }
KB_HD float kb_f(float x) { return x; }
KB_HD float kb_f(double x) { return (float)x; }
KB_HD float kb_f(int x) { return (float)x; }
KB_HD float kb_f(long long x) { return (float)x; }
KB_HD float kb_f(bool x) { return x ? 1.0f : 0.0f; }
KB_HD float kb_f(__nv_bfloat16 x) { return __bfloat162float(x); }
KB_HD float kb_f(__half x) { return __half2float(x); }
template <typename T> KB_HD T kb_cvt(float x) { return (T)x; }
template <> KB_HD __nv_bfloat16 kb_cvt<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> KB_HD __half kb_cvt<__half>(float x) { return __float2half(x); }
template <> KB_HD bool kb_cvt<bool>(float x) { return x != 0.0f; }
""".strip("\n")


def cxx_type(kind: Kind) -> str:
    return _CXX_TYPE[kind]


def float_literal(v: float) -> str:
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    text = repr(float(v))
    return f"{text}f" if ("e" in text or "." in text) else f"{text}.0f"


def _const(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return float_literal(v)
    return f"{v}LL"


@dataclass(frozen=True)
class IntWidth:
    """Which INT nodes `lower_cexpr` computes in 32 bits: `narrow(e)` (the caller's range proof, asked of INT
    nodes only) and the codes of names that are already `int` (they need no conversion)."""

    narrow: Callable[[Expr], bool]
    int_codes: frozenset[str] = field(default_factory=frozenset)


def _as(kind: Kind, code: str, have: Kind, itype: str = "long long") -> str:
    """`code` (of kind `have`) converted to `kind` (INT as `itype`)."""
    if kind is have:
        return code
    return f"(({itype if kind is Kind.INT else _CXX_TYPE[kind]})({code}))"


def _is_narrow(e: Expr, ctx: ExprContext, width: IntWidth | None) -> bool:
    return width is not None and expr_kind(e, ctx) is Kind.INT and width.narrow(e)


def lower_cexpr(e: Expr, ctx: ExprContext, width: IntWidth | None = None) -> str:
    """C++ source text computing `e` (a `long long`, `float` or `bool` by `expr_kind`; an `int` where `width`
    marks the node narrow)."""
    op = e.op
    narrow = _is_narrow(e, ctx, width)
    if op is ExprOp.CONST:
        return str(e.value) if narrow else _const(e.value)
    if op is ExprOp.VAR:
        sym = lookup(e, ctx)
        return f"((int)({sym.code}))" if narrow and width is not None and sym.code not in width.int_codes else sym.code
    if op is ExprOp.LOAD:
        return _lower_load(e, ctx, width, narrow)
    args = [lower_cexpr(a, ctx, width) for a in e.args]
    kinds = [expr_kind(a, ctx) for a in e.args]
    kind = expr_kind(e, ctx)
    if width is not None:
        return _lower_sized(e, ctx, width, narrow, args, kinds, kind)
    return _lower_op(e, ctx, args, kinds, kind)


def _lower_sized(e: Expr, ctx: ExprContext, width: IntWidth, narrow: bool, args: list[str], kinds: list[Kind],
                 kind: Kind) -> str:
    """`_lower_op` with 32-bit INT nodes: a narrow node's INT operands are narrow too (the caller's rule); in a wide
    context (a wide INT node, or a comparison with a wide operand) narrow INT operands widen to `long long`.
    FLOAT nodes take `int` operands as they are (an `int` -> `float` conversion is the cheap one)."""
    small = [k is Kind.INT and _is_narrow(a, ctx, width) for a, k in zip(e.args, kinds)]
    if e.op in CMP_OPS:
        wide_ctx = not all(s for s, k in zip(small, kinds) if k is Kind.INT)
    else:
        wide_ctx = kind is Kind.INT and not narrow
    if wide_ctx:
        args = [(f"{a.value}LL" if a.op is ExprOp.CONST else f"((long long)({code}))") if s else code
                for a, code, s in zip(e.args, args, small)]
    if not narrow:
        return _lower_op(e, ctx, args, kinds, kind)
    return _lower_op(e, ctx, args, kinds, kind, itype="int", suffix="32")


def _lower_op(e: Expr, ctx: ExprContext, args: list[str], kinds: list[Kind], kind: Kind, itype: str = "long long",
              suffix: str = "") -> str:
    """An operation node from its lowered operands; `itype`/`suffix` give the INT type and helper names."""
    op = e.op
    if op is ExprOp.NEG:
        return f"(-{args[0]})"
    if op in (ExprOp.AND, ExprOp.OR, ExprOp.NOT) and is_bitwise(e, ctx):
        ints = [_as(Kind.INT, a, k, itype) for a, k in zip(args, kinds)]
        return f"(~{ints[0]})" if op is ExprOp.NOT else f"({ints[0]} {op.value} {ints[1]})"
    if op is ExprOp.NOT:
        return f"(!{args[0]})"
    if op in (ExprOp.AND, ExprOp.OR):
        return f"({args[0]} {'&&' if op is ExprOp.AND else '||'} {args[1]})"
    if op in (ExprOp.SHL, ExprOp.SHR):
        return f"({_as(Kind.INT, args[0], kinds[0], itype)} {op.value} {_as(Kind.INT, args[1], kinds[1], itype)})"
    if op in (ExprOp.FLOORDIV, ExprOp.MOD):
        if kind is Kind.FLOAT:
            fn = "kb_floordivf" if op is ExprOp.FLOORDIV else "kb_floormodf"
            return f"{fn}({_as(Kind.FLOAT, args[0], kinds[0])}, {_as(Kind.FLOAT, args[1], kinds[1])})"
        if all(is_nonneg(a, ctx) for a in e.args):
            return f"({args[0]} {'/' if op is ExprOp.FLOORDIV else '%'} {args[1]})"
        fn = "kb_floordiv" if op is ExprOp.FLOORDIV else "kb_floormod"
        return f"{fn}{suffix}({args[0]}, {args[1]})"
    if op is ExprOp.DIV:
        return f"({_as(Kind.FLOAT, args[0], kinds[0])} / {_as(Kind.FLOAT, args[1], kinds[1])})"
    if op in (ExprOp.ADD, ExprOp.SUB, ExprOp.MUL):
        a, b = (_as(Kind.INT, x, k, itype) if k is Kind.BOOL else x for x, k in zip(args, kinds))
        return f"({a} {op.value} {b})"
    if op in CMP_OPS:
        return f"({args[0]} {op.value} {args[1]})"
    if op is ExprOp.WHERE:
        c = args[0]
        x, y = (_as(kind, a, k, itype) for a, k in zip(args[1:], kinds[1:]))
        return f"({c} ? {x} : {y})"
    if op in (ExprOp.MAXIMUM, ExprOp.MINIMUM):
        fn = "kb_max" if op is ExprOp.MAXIMUM else "kb_min"
        want = Kind.FLOAT if kind is Kind.FLOAT else Kind.INT
        fn += suffix if want is Kind.INT else ""
        return f"{fn}({_as(want, args[0], kinds[0], itype)}, {_as(want, args[1], kinds[1], itype)})"
    if op is ExprOp.CDIV:
        return f"kb_cdiv{suffix}({_as(Kind.INT, args[0], kinds[0], itype)}, {_as(Kind.INT, args[1], kinds[1], itype)})"
    if op is ExprOp.ABS:
        want = Kind.FLOAT if kinds[0] is Kind.FLOAT else Kind.INT
        return f"kb_abs{suffix if want is Kind.INT else ''}({_as(want, args[0], kinds[0], itype)})"
    if op is ExprOp.TRUNC:
        return _as(Kind.INT, args[0], kinds[0], itype)  # a float -> integer conversion truncates toward zero
    if op in _FLOAT_FN:
        return f"{_FLOAT_FN[op]}({_as(Kind.FLOAT, args[0], kinds[0])})"
    raise AssertionError(f"unhandled expression op {op}")


def _lower_load(e: Expr, ctx: ExprContext, width: IntWidth | None = None, narrow: bool = False) -> str:
    ref = aux_ref(e, ctx)
    kind = ref.kind
    # indices may be 32-bit; the strides are `long long`, so the offset is computed in 64 bits either way
    idx = [_as(Kind.INT, lower_cexpr(a, ctx, width), expr_kind(a, ctx)) for a in e.args]
    offset = " + ".join(f"{i} * {s}" for i, s in zip(idx, ref.strides))
    guards = index_guards(e, idx, ctx, "0LL")
    elem = f"{ref.code}[{offset}]"
    if kind is Kind.FLOAT:
        return f"({' && '.join(guards)} ? kb_f({elem}) : 0.0f)"
    if kind is Kind.INT and narrow:
        return f"({' && '.join(guards)} ? (int)({elem}) : 0)"
    if kind is Kind.INT:
        return f"({' && '.join(guards)} ? (long long)({elem}) : 0LL)"
    return f"({' && '.join(guards)} && (bool)({elem}))"
