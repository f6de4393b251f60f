"""Operator sugar on IR expressions (kb.ir.expr): each operator builds the same tree as the hand-built node,
numbers beside an Expr become constants of their own type on either side, comparisons build Exprs while `==`
stays structural (Exprs are dict keys), and what the sugar builds prints and parses back to itself."""

from __future__ import annotations

import math

import pytest

from kb.ir.expr import Expr, ExprOp, call, const, load, number, parse_expr, print_expr, var

x, y = var("x"), var("y")


@pytest.mark.parametrize("built, op, args", [
    (x + y, ExprOp.ADD, (x, y)),
    (x - y, ExprOp.SUB, (x, y)),
    (x * y, ExprOp.MUL, (x, y)),
    (x / y, ExprOp.DIV, (x, y)),
    (x // y, ExprOp.FLOORDIV, (x, y)),
    (x % y, ExprOp.MOD, (x, y)),
    (x << y, ExprOp.SHL, (x, y)),
    (x >> y, ExprOp.SHR, (x, y)),
    (x < y, ExprOp.LT, (x, y)),
    (x <= y, ExprOp.LE, (x, y)),
    (x > y, ExprOp.GT, (x, y)),
    (x >= y, ExprOp.GE, (x, y)),
    (x.eq(y), ExprOp.EQ, (x, y)),
    (x.ne(y), ExprOp.NE, (x, y)),
    (x & y, ExprOp.AND, (x, y)),
    (x | y, ExprOp.OR, (x, y)),
    (~x, ExprOp.NOT, (x,)),
    (-x, ExprOp.NEG, (x,)),
])
def test_each_operator_builds_its_node(built: Expr, op: ExprOp, args: tuple[Expr, ...]) -> None:
    assert built == Expr(op, args)


@pytest.mark.parametrize("built, want", [
    (2 * x, Expr(ExprOp.MUL, (const(2), x))),
    (x * 2, Expr(ExprOp.MUL, (x, const(2)))),
    (1.0 + x, Expr(ExprOp.ADD, (const(1.0), x))),
    (1 - x, Expr(ExprOp.SUB, (const(1), x))),
    (1 / x, Expr(ExprOp.DIV, (const(1), x))),
    (7 // x, Expr(ExprOp.FLOORDIV, (const(7), x))),
    (7 % x, Expr(ExprOp.MOD, (const(7), x))),
    (True & x, Expr(ExprOp.AND, (const(True), x))),
    (False | x, Expr(ExprOp.OR, (const(False), x))),
    (0 < x, Expr(ExprOp.GT, (x, const(0)))),  # Python reflects the comparison: `0 < x` is `x > 0`
])
def test_numbers_lift_on_either_side(built: Expr, want: Expr) -> None:
    assert built == want


def test_lifted_constants_keep_their_type() -> None:
    assert type((x * 2).args[1].value) is int
    assert type((x * 2.0).args[1].value) is float
    assert type((x & True).args[1].value) is bool
    assert x * 2 == x * 2.0  # structural equality is Python's on the values (2 == 2.0) ...
    assert print_expr(x * 2) != print_expr(x * 2.0)  # ... the text tells them apart


def test_negation_folds_numeric_constants_as_the_parser_does() -> None:
    assert -const(3) == const(-3)
    assert -const(2.5) == const(-2.5)
    assert -const(-math.inf) == const(math.inf)
    assert -const(True) == Expr(ExprOp.NEG, (const(True),))  # -True stays a negation, as parsed
    assert -(-x) == Expr(ExprOp.NEG, (Expr(ExprOp.NEG, (x,)),))
    for e in (-const(3), -const(True), -(x + 1)):
        assert parse_expr(print_expr(e)) == e


def test_equality_stays_structural_and_hashable() -> None:
    assert (x == var("x")) is True
    assert (x != y) is True
    assert x.eq(1) != x.ne(1)
    table = {x + 1: "a", x.eq(y): "b"}
    assert table[var("x") + 1] == "a" and table[x.eq(y)] == "b"
    assert len({x < 1, x < 1, x <= 1}) == 2
    assert isinstance(x < y, Expr) and isinstance(x >= 1, Expr)


@pytest.mark.parametrize("built, text", [
    (var("score") + load("slopes", var("h")) * (var("kv_idx") - var("q_idx")), "score + slopes[h] * (kv_idx - q_idx)"),
    (call("where", (var("q_idx") >= var("kv_idx")) & load("doc", var("b"), var("q_idx")).eq(load("doc", var("b"), var("kv_idx"))),
          var("score"), const(-math.inf)),
     "where((q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx]), score, -inf)"),
    (var("softcap") * call("tanh", var("score") / var("softcap")), "softcap * tanh(score / softcap)"),
    (~((x > 1) | (y < 2)), "~((x > 1) | (y < 2))"),
    (-(x - y) * 2, "-(x - y) * 2"),
    (2 * (x // 4 % 3), "2 * (x // 4 % 3)"),
    (1 - (x - y), "1 - (x - y)"),
    ((x << 2) >> y, "x << 2 >> y"),
])
def test_sugar_prints_the_text_form_and_parses_back(built: Expr, text: str) -> None:
    assert print_expr(built) == text
    assert parse_expr(text) == built


def test_number_reads_numeric_constants_only() -> None:
    assert number(const(3)) == 3 and number(const(True)) is True
    for e in (x, load("t", x), x + 1):
        with pytest.raises(TypeError):
            number(e)
