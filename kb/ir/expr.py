"""The expression language of the IR: variant slots, loop bounds and tile math.

An `Expr` is a frozen tree of one node class with an `ExprOp` kind (tinygrad style).
Its text form is a subset of Python expression syntax, so it is parsed with `ast`:

    where((q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx]), score, -inf)
    softcap * tanh(score / softcap)
    score + slopes[h] * (kv_idx - q_idx)

Invariants:
- `parse_expr(print_expr(e)) == e` for every well-formed `e` (printing is canonical:
  minimal parentheses by precedence, floats in `repr` form). Well-formed includes: a NEG
  never wraps a numeric constant (negative constants are folded, as the parser and `-e`
  do; build them with `const(-x)` or `-const(x)`).

- `&`, `|`, `~` are Python's (and torch's): logical and/or/not on boolean operands, bitwise on integer
  operands (a boolean beside an integer counts as 0 or 1); `<<` and `>>` shift integers (`>>` is
  arithmetic: floor division by a power of two, as in Python).
- `LOAD` reads an auxiliary tensor: `value` is the tensor name, `args` the indices.
- Constants are int, float or bool; `inf` is the float infinity (a VAR named `inf` never exists).
- `trunc(x)` is an integer: x truncated toward zero (torch's `.to(torch.int64)` of a float, so
  `trunc(-2.5) == -2`); an integer operand is unchanged, a boolean one becomes 0 or 1.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from enum import Enum
from typing import Iterator

from kb.errors import KBError

__all__ = [
    "ExprOp",
    "Expr",
    "const",
    "number",
    "var",
    "load",
    "call",
    "parse_expr",
    "print_expr",
    "free_vars",
    "loaded_tensors",
    "walk",
    "substitute",
    "replace_subexprs",
    "CALLS",
]


class ExprOp(Enum):
    CONST = "const"
    VAR = "var"
    LOAD = "load"
    # binary arithmetic
    ADD = "+"
    SUB = "-"
    MUL = "*"
    DIV = "/"
    FLOORDIV = "//"
    MOD = "%"
    # comparisons (non-chaining)
    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="
    EQ = "=="
    NE = "!="
    # logical (on booleans)
    AND = "&"
    OR = "|"
    NOT = "~"
    SHL = "<<"
    SHR = ">>"
    NEG = "neg"
    # calls
    WHERE = "where"
    EXP = "exp"
    EXP2 = "exp2"
    LOG = "log"
    TANH = "tanh"
    SIGMOID = "sigmoid"
    ABS = "abs"
    SQRT = "sqrt"
    MAXIMUM = "maximum"
    MINIMUM = "minimum"
    CDIV = "cdiv"
    TRUNC = "trunc"  # float -> integer, toward zero
    ERF = "erf"  # the error function (exact GELU: x * (1 + erf(x / sqrt(2))) / 2)


# name -> (op, arity)
CALLS: dict[str, tuple[ExprOp, int]] = {
    op.value: (op, 3 if op is ExprOp.WHERE else 2 if op in (ExprOp.MAXIMUM, ExprOp.MINIMUM, ExprOp.CDIV) else 1)
    for op in (
        ExprOp.WHERE, ExprOp.EXP, ExprOp.EXP2, ExprOp.LOG, ExprOp.TANH, ExprOp.SIGMOID,
        ExprOp.ABS, ExprOp.SQRT, ExprOp.MAXIMUM, ExprOp.MINIMUM, ExprOp.CDIV, ExprOp.TRUNC, ExprOp.ERF,
    )
}

_BINARY = {
    ExprOp.ADD, ExprOp.SUB, ExprOp.MUL, ExprOp.DIV, ExprOp.FLOORDIV, ExprOp.MOD,
    ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE, ExprOp.EQ, ExprOp.NE, ExprOp.AND, ExprOp.OR,
    ExprOp.SHL, ExprOp.SHR,
}
_COMPARE = {ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE, ExprOp.EQ, ExprOp.NE}
# Python precedence, higher binds tighter.
_PREC = {
    ExprOp.OR: 1, ExprOp.AND: 3, ExprOp.SHL: 4, ExprOp.SHR: 4,
    **{op: 0 for op in _COMPARE},
    ExprOp.ADD: 5, ExprOp.SUB: 5,
    ExprOp.MUL: 6, ExprOp.DIV: 6, ExprOp.FLOORDIV: 6, ExprOp.MOD: 6,
    ExprOp.NEG: 7, ExprOp.NOT: 7,
}
_ATOM_PREC = 9


@dataclass(frozen=True)
class Expr:
    op: ExprOp
    args: tuple["Expr", ...] = ()
    value: int | float | bool | str | None = None

    def __str__(self) -> str:
        return print_expr(self)

    # Operator sugar so builders and tests read like the text form: `score + slopes[h] * (kv_idx - q_idx)`.
    # A Python number beside an Expr becomes `const(x)` (its type kept: 2 is an int, 2.0 a float), on
    # either side (`2 * e` is `const(2) * e`). `==` and `!=` stay structural (Exprs are dict keys and
    # set members): build the comparisons with `e.eq(o)` and `e.ne(o)`. `<`, `<=`, `>`, `>=` build
    # Exprs, so an Expr is never ordered (and `0 < e` is Python's reflection, `e > 0`). `&`, `|`, `~`
    # are the IR's AND, OR, NOT (logical on booleans, bitwise on integers, as printed).
    def __add__(self, o: Operand) -> Expr:
        return _bin(ExprOp.ADD, self, o)

    def __radd__(self, o: Operand) -> Expr:
        return _bin(ExprOp.ADD, o, self)

    def __sub__(self, o: Operand) -> Expr:
        return _bin(ExprOp.SUB, self, o)

    def __rsub__(self, o: Operand) -> Expr:
        return _bin(ExprOp.SUB, o, self)

    def __mul__(self, o: Operand) -> Expr:
        return _bin(ExprOp.MUL, self, o)

    def __rmul__(self, o: Operand) -> Expr:
        return _bin(ExprOp.MUL, o, self)

    def __truediv__(self, o: Operand) -> Expr:
        return _bin(ExprOp.DIV, self, o)

    def __rtruediv__(self, o: Operand) -> Expr:
        return _bin(ExprOp.DIV, o, self)

    def __floordiv__(self, o: Operand) -> Expr:
        return _bin(ExprOp.FLOORDIV, self, o)

    def __rfloordiv__(self, o: Operand) -> Expr:
        return _bin(ExprOp.FLOORDIV, o, self)

    def __mod__(self, o: Operand) -> Expr:
        return _bin(ExprOp.MOD, self, o)

    def __rmod__(self, o: Operand) -> Expr:
        return _bin(ExprOp.MOD, o, self)

    def __lshift__(self, o: Operand) -> Expr:
        return _bin(ExprOp.SHL, self, o)

    def __rshift__(self, o: Operand) -> Expr:
        return _bin(ExprOp.SHR, self, o)

    def __neg__(self) -> Expr:
        """`-e`; a numeric constant is folded (`-const(2) == const(-2)`), as the parser folds `-2`."""
        if self.op is ExprOp.CONST and not isinstance(self.value, bool):
            return const(-number(self))
        return Expr(ExprOp.NEG, (self,))

    def __lt__(self, o: Operand) -> Expr:
        return _bin(ExprOp.LT, self, o)

    def __le__(self, o: Operand) -> Expr:
        return _bin(ExprOp.LE, self, o)

    def __gt__(self, o: Operand) -> Expr:
        return _bin(ExprOp.GT, self, o)

    def __ge__(self, o: Operand) -> Expr:
        return _bin(ExprOp.GE, self, o)

    def eq(self, o: Operand) -> Expr:
        """The comparison `self == o` as an Expr (Python's `==` on Exprs is structural equality)."""
        return _bin(ExprOp.EQ, self, o)

    def ne(self, o: Operand) -> Expr:
        """The comparison `self != o` as an Expr."""
        return _bin(ExprOp.NE, self, o)

    def __and__(self, o: Operand) -> Expr:
        return _bin(ExprOp.AND, self, o)

    def __rand__(self, o: Operand) -> Expr:
        return _bin(ExprOp.AND, o, self)

    def __or__(self, o: Operand) -> Expr:
        return _bin(ExprOp.OR, self, o)

    def __ror__(self, o: Operand) -> Expr:
        return _bin(ExprOp.OR, o, self)

    def __invert__(self) -> Expr:
        return Expr(ExprOp.NOT, (self,))


Operand = Expr | int | float | bool  # what the operator sugar accepts beside an Expr


def _lift(x: Operand) -> Expr:
    return x if isinstance(x, Expr) else const(x)


def _bin(op: ExprOp, a: Operand, b: Operand) -> Expr:
    return Expr(op, (_lift(a), _lift(b)))


def const(value: int | float | bool) -> Expr:
    return Expr(ExprOp.CONST, (), value)


def number(e: Expr) -> int | float:
    """The value of the numeric constant `e` (a bool constant counts as 0 or 1, as in Python
    arithmetic); TypeError when `e` is no numeric constant. Callers check the kind first."""
    if e.op is not ExprOp.CONST or not isinstance(e.value, (int, float)):
        raise TypeError(f"not a numeric constant: {e!r}")
    return e.value


def var(name: str) -> Expr:
    return Expr(ExprOp.VAR, (), name)


def load(tensor: str, *index: Expr) -> Expr:
    return Expr(ExprOp.LOAD, tuple(index), tensor)


def call(name: str, *args: Expr) -> Expr:
    op, arity = CALLS[name]
    if len(args) != arity:
        raise KBError(f"{name}() takes {arity} arguments, got {len(args)}")
    return Expr(op, tuple(args))


# ---------------------------------------------------------------- printing


def _print_const(v: int | float | bool | str | None) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if math.isnan(v):
            raise KBError("NaN constants are not allowed in IR expressions")
        return repr(v)
    return str(v)


def _prec(e: Expr) -> int:
    if e.op is ExprOp.CONST and isinstance(e.value, (int, float)) and not isinstance(e.value, bool) and e.value < 0:
        return _PREC[ExprOp.NEG]  # printed with a leading minus
    return _PREC.get(e.op, _ATOM_PREC)


def print_expr(e: Expr) -> str:
    """Canonical text of `e` (minimal parentheses)."""
    if e.op is ExprOp.CONST:
        return _print_const(e.value)
    if e.op is ExprOp.VAR:
        return str(e.value)
    if e.op is ExprOp.LOAD:
        return f"{e.value}[{', '.join(print_expr(a) for a in e.args)}]"
    if e.op in (ExprOp.NEG, ExprOp.NOT):
        (a,) = e.args
        inner = print_expr(a)
        if _prec(a) < _PREC[e.op] or (a.op is ExprOp.CONST and _prec(a) == _PREC[e.op]):
            inner = f"({inner})"
        return ("-" if e.op is ExprOp.NEG else "~") + inner
    if e.op in _BINARY:
        lhs, rhs = e.args
        p = _PREC[e.op]
        ls, rs = print_expr(lhs), print_expr(rhs)
        # comparisons never chain; left-assoc ops need parens on an equal-precedence right child
        if _prec(lhs) < p or (e.op in _COMPARE and lhs.op in _COMPARE):
            ls = f"({ls})"
        if _prec(rhs) <= p:
            rs = f"({rs})"
        return f"{ls} {e.op.value} {rs}"
    return f"{e.op.value}({', '.join(print_expr(a) for a in e.args)})"


# ---------------------------------------------------------------- parsing

_AST_BIN = {
    ast.Add: ExprOp.ADD, ast.Sub: ExprOp.SUB, ast.Mult: ExprOp.MUL, ast.Div: ExprOp.DIV,
    ast.FloorDiv: ExprOp.FLOORDIV, ast.Mod: ExprOp.MOD, ast.BitAnd: ExprOp.AND, ast.BitOr: ExprOp.OR,
    ast.LShift: ExprOp.SHL, ast.RShift: ExprOp.SHR,
}
_AST_CMP = {
    ast.Lt: ExprOp.LT, ast.LtE: ExprOp.LE, ast.Gt: ExprOp.GT, ast.GtE: ExprOp.GE,
    ast.Eq: ExprOp.EQ, ast.NotEq: ExprOp.NE,
}


def parse_expr(text: str, *, line: int = 1, col: int = 1) -> Expr:
    """Parse the text form; errors name the line and column (offset by `line`/`col`)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as err:
        raise KBError(f"line {line}, column {col + (err.offset or 1) - 1}: cannot parse expression {text.strip()!r}: {err.msg}") from None
    return _from_ast(tree.body, line, col)


def _err(node: ast.AST, line: int, col: int, msg: str) -> KBError:
    return KBError(f"line {line + getattr(node, 'lineno', 1) - 1}, column {col + getattr(node, 'col_offset', 0)}: {msg}")


def _from_ast(n: ast.AST, line: int, col: int) -> Expr:
    if isinstance(n, ast.Constant) and isinstance(n.value, (bool, int, float)):
        return const(n.value)
    if isinstance(n, ast.Name):
        if n.id == "inf":
            return const(math.inf)
        if n.id in ("True", "False"):
            return const(n.id == "True")
        return var(n.id)
    if isinstance(n, ast.UnaryOp):
        inner = _from_ast(n.operand, line, col)
        if isinstance(n.op, ast.USub):
            if inner.op is ExprOp.CONST and not isinstance(inner.value, bool) and isinstance(n.operand, ast.Constant | ast.Name):
                return const(-number(inner))
            return Expr(ExprOp.NEG, (inner,))
        if isinstance(n.op, ast.Invert):
            return Expr(ExprOp.NOT, (inner,))
        if isinstance(n.op, ast.UAdd):
            return inner
        raise _err(n, line, col, f"unsupported unary operator {type(n.op).__name__}")
    if isinstance(n, ast.BinOp):
        op = _AST_BIN.get(type(n.op))
        if op is None:
            raise _err(n, line, col, f"unsupported operator {type(n.op).__name__}")
        return Expr(op, (_from_ast(n.left, line, col), _from_ast(n.right, line, col)))
    if isinstance(n, ast.Compare):
        if len(n.ops) != 1:
            raise _err(n, line, col, "chained comparisons are not allowed; use parentheses and &")
        op = _AST_CMP.get(type(n.ops[0]))
        if op is None:
            raise _err(n, line, col, f"unsupported comparison {type(n.ops[0]).__name__}")
        return Expr(op, (_from_ast(n.left, line, col), _from_ast(n.comparators[0], line, col)))
    if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
        idx = n.slice.elts if isinstance(n.slice, ast.Tuple) else [n.slice]
        return load(n.value.id, *(_from_ast(i, line, col) for i in idx))
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and not n.keywords:
        if n.func.id not in CALLS:
            raise _err(n, line, col, f"unknown function {n.func.id}(); known: {', '.join(sorted(CALLS))}")
        op, arity = CALLS[n.func.id]
        if len(n.args) != arity:
            raise _err(n, line, col, f"{n.func.id}() takes {arity} arguments, got {len(n.args)}")
        return Expr(op, tuple(_from_ast(a, line, col) for a in n.args))
    raise _err(n, line, col, f"unsupported syntax {type(n).__name__} in expression")


# ---------------------------------------------------------------- queries


def walk(e: Expr) -> Iterator[Expr]:
    """Pre-order traversal."""
    yield e
    for a in e.args:
        yield from walk(a)


def free_vars(e: Expr) -> frozenset[str]:
    return frozenset(str(n.value) for n in walk(e) if n.op is ExprOp.VAR)


def loaded_tensors(e: Expr) -> frozenset[str]:
    return frozenset(str(n.value) for n in walk(e) if n.op is ExprOp.LOAD)


def substitute(e: Expr, mapping: dict[str, Expr]) -> Expr:
    """Replace variables by expressions (capture-free: the language has no binders)."""
    if e.op is ExprOp.VAR and e.value in mapping:
        return mapping[str(e.value)]
    if not e.args:
        return e
    return Expr(e.op, tuple(substitute(a, mapping) for a in e.args), e.value)


def replace_subexprs(e: Expr, table: dict[Expr, Expr]) -> Expr:
    """`e` with each subexpression that is a key of `table` replaced by its value (outermost match first; what a
    replacement puts in is not searched again)."""
    if e in table:
        return table[e]
    if not e.args:
        return e
    return Expr(e.op, tuple(replace_subexprs(a, table) for a in e.args), e.value)
