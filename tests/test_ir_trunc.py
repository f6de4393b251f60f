"""The expression language's float -> integer truncation `trunc(x)`: text form, torch evaluation,
validator typing and symbolic derivative. Lowerings: tests/test_lower_triton.py, tests/test_lower_cuda.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kb.errors import KBError
from kb.ir.derive import aux_partials, derivative, score_grad
from kb.ir.evaluate import eval_expr
from kb.ir.expr import CALLS, Expr, ExprOp, call, const, parse_expr, print_expr, var
from kb.ir.nodes import Load, Span
from kb.ir.validate import problems
from kb.lower.expr_context import ExprContext, ExprTarget, Kind, Sym, expr_kind, is_nonneg
from kb.lower.triton_expr import lower_expr
from tests.support.ir_programs import plain


@pytest.mark.parametrize("text", [
    "trunc(x)", "trunc(-2.5)", "trunc(log(maximum(abs(kv_idx - q_idx), 1) / 8) / 2.5 * 8) + 8",
    "-trunc(score * 3.0)", "rel[trunc(x / 4) % 16, h]", "trunc(trunc(x) > 0)",
])
def test_text_round_trip(text: str) -> None:
    e = parse_expr(text)
    assert parse_expr(print_expr(e)) == e
    assert print_expr(e) == text


def test_trunc_is_a_one_argument_call() -> None:
    assert CALLS["trunc"] == (ExprOp.TRUNC, 1)
    assert parse_expr("trunc(x)") == Expr(ExprOp.TRUNC, (var("x"),)) == call("trunc", var("x"))
    with pytest.raises(KBError, match=r"trunc\(\) takes 1 arguments, got 2"):
        parse_expr("trunc(x, 2)")


def test_evaluation_truncates_toward_zero() -> None:
    x = torch.tensor([-2.7, -2.5, -0.5, -0.0, 0.3, 2.5, 2.999, 7.0])
    got = eval_expr(parse_expr("trunc(x)"), {"x": x})
    assert got.dtype == torch.int64
    assert got.tolist() == [-2, -2, 0, 0, 0, 2, 2, 7]  # not floor: -2.7 -> -2
    assert got.tolist() == x.to(torch.int64).tolist()  # torch's cast, the spec's `.to(torch.int64)`
    # Python scalars give Python ints; integer and boolean operands pass through as numbers
    assert eval_expr(parse_expr("trunc(-7 / 2)"), {}) == -3
    assert eval_expr(parse_expr("trunc(q_idx - kv_idx)"), {"q_idx": 2, "kv_idx": 5}) == -3
    assert eval_expr(parse_expr("trunc(x > 0)"), {"x": torch.tensor([-1.0, 1.0])}).tolist() == [0, 1]
    with pytest.raises(KBError, match="no integer value"):
        eval_expr(parse_expr("trunc(x)"), {"x": float("inf")})


def test_trunc_result_indexes_a_table() -> None:
    table = torch.arange(10.0) * 10
    d = torch.arange(-6, 7)
    got = eval_expr(parse_expr("t[trunc(abs(d) / 2.0)]"), {"d": d}, {"t": table})
    assert got.tolist() == (torch.div(d.abs(), 2, rounding_mode="trunc") * 10.0).tolist()


def _with_until(until: str):
    """plain() whose q load is bounded by `until`."""
    k = plain().kernels[0]
    body = tuple(replace(st, index=tuple(replace(ix, until=parse_expr(until)) if isinstance(ix, Span) else ix
                                         for ix in st.index)) if isinstance(st, Load) and st.tensor == "q" else st
                 for st in k.body)
    return replace(plain(), kernels=(replace(k, body=body),))


def test_validator_types_trunc_as_an_integer() -> None:
    assert problems(_with_until("trunc(M * 0.75)")) == ()
    assert problems(_with_until("trunc(M / 2) + 1")) == ()
    found = [str(x) for x in problems(_with_until("trunc(M * 0.75) + 0.5"))]
    assert len(found) == 1 and "must be an integer expression; 0.5 is a float" in found[0]
    found = [str(x) for x in problems(_with_until("M * 0.75"))]
    assert len(found) == 1 and "is a float" in found[0]


def test_lowering_kind_and_sign() -> None:
    ctx = ExprContext(ExprTarget.DEVICE, {"x": Sym("x", Kind.FLOAT), "n": Sym("n", Kind.INT, nonneg=True),
                                          "d": Sym("d", Kind.INT)})
    assert expr_kind(parse_expr("trunc(x)"), ctx) is Kind.INT
    assert expr_kind(parse_expr("trunc(x) + 1"), ctx) is Kind.INT
    assert is_nonneg(parse_expr("trunc(abs(x) * 3.0)"), ctx)  # toward zero: never below 0 from a value >= 0
    assert is_nonneg(parse_expr("trunc(n)"), ctx) and not is_nonneg(parse_expr("trunc(d * 0.5)"), ctx)
    assert lower_expr(parse_expr("trunc(x * 2.0)"), ctx) == "((x * 2.0)).to(tl.int32)"
    assert lower_expr(parse_expr("trunc(d) + trunc(-2.5)"), ctx) == "(d + -2)"  # an integer is already truncated
    host = ExprContext(ExprTarget.HOST, ctx.names)
    assert lower_expr(parse_expr("trunc(x)"), host) == "_htrunc(x)"


def test_derivative_is_zero() -> None:
    assert derivative(parse_expr("trunc(score * 3.0)"), "score") == const(0)
    assert print_expr(score_grad(parse_expr("score + trunc(score) * 0.5"))) == "1"
    # a table read at a truncated index: the table's partial is 1, its index is piecewise constant
    body = parse_expr("score + rel[trunc(log(maximum(abs(kv_idx - q_idx), 1) / 8) * 4) % 16, h]")
    (idx, partial), = aux_partials(body, "rel")
    assert print_expr(idx[0]) == "trunc(log(maximum(abs(kv_idx - q_idx), 1) / 8) * 4) % 16" and partial == const(1)
