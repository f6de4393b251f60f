"""The expression algebra (kb.ir.algebra): each rewrite's rules on small expressions, splitting and
building, comparison flips, linear forms, next_pow2, and the schedule's head pad."""

from __future__ import annotations

import pytest

from kb.ir.algebra import (
    FLIP, NEGATE, all_of, any_of, conjunction, conjuncts, disjuncts, from_poly, linear_form, max_of, min_of,
    is_pow2, next_pow2, normal_compare, normal_form, simplify, tidy_int, to_poly,
)
from kb.ir.expr import Expr, ExprOp, parse_expr as E
from kb.ir.nodes import DOT_MIN_K, Schedule


@pytest.mark.parametrize("text, want", [
    ("1 + 2", "3"),
    ("minimum(3, 4)", "3"),
    ("x + 0", "x"),
    ("0 + x", "x"),
    ("x + -2", "x - 2"),
    ("x + -y", "x - y"),
    ("x + 1 - 3", "x - 2"),
    ("0 - x", "-x"),
    ("x * 1", "x"),
    ("-1 * x", "-x"),
    ("x * 2 * 3", "x * 6"),
    ("x / 1", "x"),
    ("--x", "x"),
    ("~~c", "c"),
    ("~(a > b)", "a <= b"),
    ("~((a > b) & (c == d))", "(a <= b) | (c != d)"),
    ("True & c", "c"),
    ("c & c", "c"),
    ("c & False", "False"),
    ("False | c", "c"),
    ("c | True", "True"),
    ("where(True, x, y)", "x"),
    ("where(c, x, x)", "x"),
    ("where(c, True, False)", "c"),
    ("where(c, False, True)", "~c"),
    ("where(a > b, 1, 0) == 0", "a <= b"),
    ("(x - 1) == (y - 1)", "x == y"),
    ("1 / 0", "1 / 0"),  # unfoldable constants are left alone
])
def test_simplify_rules(text: str, want: str) -> None:
    assert simplify(E(text)) == E(want)


def test_simplify_keeps_loads() -> None:
    e = E("doc[b, 0 + q_idx]")
    assert simplify(e) == E("doc[b, q_idx]")


@pytest.mark.parametrize("text, want", [
    ("1 + 2 - 4", "-1"),
    ("x + 0", "x"),
    ("0 - x", "-x"),
    ("-(x - y)", "y - x"),
    ("--x", "x"),
    ("x - -y", "x + y"),
    ("x + -y", "x - y"),
    ("x - 1 + 3", "x + 2"),
    ("x + 1 - 3", "x - 2"),
    ("1 * x", "x"),
    ("x * 1", "x"),
])
def test_tidy_int_rules(text: str, want: str) -> None:
    assert tidy_int(E(text)) == E(want)


@pytest.mark.parametrize("text", ["(0 > 255) | (x > y)", "minimum(3, 4)", "x + 0.0", "c & True", "x * 2 * 3"])
def test_tidy_int_folds_no_comparisons_calls_or_floats(text: str) -> None:
    assert tidy_int(E(text)) == E(text)


def test_tidy_int_adds_a_negative_constant_as_a_subtraction() -> None:
    assert tidy_int(Expr(ExprOp.ADD, (E("x"), E("-3")))) == E("x - 3")
    assert tidy_int(Expr(ExprOp.SUB, (E("x"), E("-3")))) == E("x + 3")


@pytest.mark.parametrize("text, want", [
    ("m * BLOCK_M + (q_idx - m * BLOCK_M)", "q_idx"),
    ("(a + 1) * (a - 1)", "a * a - 1"),
    ("kv_idx + 2 * (x - kv_idx) + q_idx", "-kv_idx + q_idx + 2 * x"),  # index terms by text, then the rest
    ("cdiv(n + 0, 2) - 3", "cdiv(n, 2) - 3"),
    ("-(4 - x)", "x - 4"),
])
def test_normal_form(text: str, want: str) -> None:
    assert normal_form(E(text)) == E(want)


def test_poly_round_trip_and_scaling() -> None:
    p = to_poly(E("2 * a * b - b * a + 3"))
    assert p == {(E("a"), E("b")): 1, (): 3}
    assert from_poly({}) == E("0")


def test_normal_compare_moves_terms_and_keeps_q_idx_left() -> None:
    assert normal_compare(ExprOp.LT, E("start_n + offs"), E("N")) == E("offs + start_n < N")
    assert normal_compare(ExprOp.LE, E("kv_idx"), E("q_idx")) == E("q_idx >= kv_idx")
    assert normal_compare(ExprOp.NE, E("kv_idx"), E("q_idx + 1")) == E("q_idx + 1 != kv_idx")


def test_flip_and_negate() -> None:
    for op, flipped in FLIP.items():
        assert FLIP[flipped] is op
    assert FLIP[ExprOp.LT] is ExprOp.GT and FLIP[ExprOp.EQ] is ExprOp.EQ
    assert NEGATE[ExprOp.LT] is ExprOp.GE and NEGATE[ExprOp.EQ] is ExprOp.NE
    assert all(NEGATE[NEGATE[op]] is op for op in NEGATE)


def test_conjuncts_and_disjuncts_split_in_order() -> None:
    e = E("(a & b) & (c | d) & e")
    assert conjuncts(e) == [E("a"), E("b"), E("c | d"), E("e")]
    assert disjuncts(E("a | (b | c & d)")) == [E("a"), E("b"), E("c & d")]
    assert conjuncts(E("a | b")) == [E("a | b")]


def test_builders_fold_to_the_left() -> None:
    xs = [E("a"), E("b"), E("c")]
    assert all_of(xs) == E("a & b & c") == E("(a & b) & c")
    assert any_of(xs) == E("(a | b) | c")
    assert min_of(xs) == E("minimum(minimum(a, b), c)")
    assert max_of(xs) == E("maximum(maximum(a, b), c)")
    assert conjunction([]) is None and conjunction(xs[:1]) == E("a")
    assert conjuncts(all_of(xs)) == xs


@pytest.mark.parametrize("text, want", [
    ("q_idx - kv_idx", (1, -1, "0 - 0")),
    ("kv_idx + W", (0, 1, "0 + W")),
    ("2 * q_idx - prefix[b]", (2, 0, "2 * 0 - prefix[b]")),
    ("-(kv_idx * 3)", (0, -3, "-(3 * 0)")),
    ("b + h", (0, 0, "b + h")),
])
def test_linear_form(text: str, want: tuple[int, int, str]) -> None:
    a, b, c = want
    assert linear_form(E(text)) == (a, b, E(c))


@pytest.mark.parametrize("text", ["q_idx * kv_idx", "doc[b, q_idx]", "q_idx // 2", "x * q_idx"])
def test_linear_form_refuses_nonlinear(text: str) -> None:
    assert linear_form(E(text)) is None


def test_powers_of_two() -> None:
    assert [n for n in range(-1, 20) if is_pow2(n)] == [1, 2, 4, 8, 16]
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 64, 65, 96, 128)] == [1, 1, 2, 4, 4, 8, 64, 128, 128, 128]


def test_schedule_head_pad() -> None:
    auto, fixed = Schedule(), Schedule(head_pad=128)
    assert auto.fixed_head_pad is None and fixed.fixed_head_pad == 128
    assert [auto.head_pad_for(d) for d in (8, 40, 64, 96)] == [8, 64, 64, 128]
    assert [auto.head_pad_for(d, DOT_MIN_K) for d in (8, 40, 64)] == [16, 64, 64]
    assert fixed.head_pad_for(40) == fixed.head_pad_for(40, DOT_MIN_K) == 128
    assert fixed.value_head_pad_for(40) == 64 and auto.value_head_pad_for(8, DOT_MIN_K) == 16
