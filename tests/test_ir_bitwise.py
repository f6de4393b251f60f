"""Integer bit operations and erf in the expression language: `&`, `|`, `~` are Python's (logical on booleans,
bitwise on integers), `<<` and `>>` shift integers, `erf(x)` (exact GELU). Text form, torch evaluation,
derivatives, value kinds and ranges, both lowerings' spelling, and a run under the Triton interpreter of a
Morton-decoded mask over a boolean table with a GELU score_mod (attention-gym's morton natten / activation)."""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

from pathlib import Path

import pytest
import torch

from kb.ir.derive import derivative, score_grad
from kb.ir.evaluate import eval_expr
from kb.ir.expr import ExprOp, const, parse_expr, print_expr
from kb.ir.nodes import Dtype, Param, Role
from kb.lower.cuda_expr import lower_cexpr
from kb.lower.cuda_range import ival
from kb.lower.expr_context import ExprContext, ExprTarget, Kind, Sym, expr_kind, is_nonneg
from kb.lower.runtime import TritonKernel
from kb.lower.triton_expr import lower_expr
from tests.support.attn_reference import reference_attention
from tests.support.ir_programs import forward


@pytest.mark.parametrize("text", [
    "x >> 1 & 858993459 | x << 2", "(x | y) >> 1 + z", "a << b + c", "~(x & 1)", "-(x >> 1)", "(a & b) << 2",
    "erf(score * 0.7071067811865476)", "q_idx & 1 == kv_idx & 1",  # Python: & binds tighter than ==
])
def test_text_round_trip(text: str) -> None:
    e = parse_expr(text)
    assert parse_expr(print_expr(e)) == e
    assert print_expr(e) == text


def test_shifts_bind_between_and_and_addition() -> None:
    assert parse_expr("a << b + c").op is ExprOp.SHL  # a << (b + c)
    assert parse_expr("a << b & c").op is ExprOp.AND  # (a << b) & c
    assert parse_expr("a >> b | c").op is ExprOp.OR


def test_evaluation_is_python_and_torch() -> None:
    x = torch.arange(-8, 40, dtype=torch.int32)
    for text, want in [("x >> 1 & 51 | x << 2", (x >> 1) & 51 | (x << 2)), ("~x & 7", ~x & 7), ("x >> 2", x >> 2)]:
        assert torch.equal(eval_expr(parse_expr(text), {"x": x}), want), text
    # Python scalars: the same rules
    assert eval_expr(parse_expr("x >> 1 & 51 | x << 2"), {"x": 37}) == (37 >> 1) & 51 | 37 << 2
    assert eval_expr(parse_expr("-5 >> 1"), {}) == -3  # arithmetic: floor division by 2
    assert eval_expr(parse_expr("True & 3"), {}) == 1 and eval_expr(parse_expr("~x"), {"x": 5}) == -6
    # booleans stay logical
    c = eval_expr(parse_expr("(x > 2) & (x < 5) | ~(x != 30)"), {"x": x})
    assert c.dtype == torch.bool and torch.equal(c, ((x > 2) & (x < 5)) | (x == 30))
    assert eval_expr(parse_expr("erf(0.5)"), {}) == pytest.approx(math.erf(0.5))


def test_derivatives() -> None:
    assert derivative(parse_expr("score + (q_idx >> 2 & 3)"), "score") == const(1)
    g = score_grad(parse_expr("log(score * 0.5 * (1.0 + erf(score * 0.7071067811865476)) + 1.0)"))
    x = torch.linspace(-3, 3, 13, dtype=torch.float64, requires_grad=True)
    y = torch.log(torch.nn.functional.gelu(x) + 1.0)
    (want,) = torch.autograd.grad(y.sum(), x)
    got = eval_expr(g, {"score": x.detach()})
    assert torch.allclose(got, want, atol=1e-6)


def _ctx(target: ExprTarget = ExprTarget.DEVICE) -> ExprContext:
    return ExprContext(target, {"q_idx": Sym("q_idx", Kind.INT, nonneg=True), "d": Sym("d", Kind.INT),
                                "c": Sym("c", Kind.BOOL), "x": Sym("x", Kind.FLOAT)})


def test_kinds_ranges_and_spelling() -> None:
    ctx = _ctx()
    bits, logic = parse_expr("q_idx >> 1 & 51"), parse_expr("c & (d > 0)")
    assert expr_kind(bits, ctx) is Kind.INT and expr_kind(logic, ctx) is Kind.BOOL
    assert expr_kind(parse_expr("~d"), ctx) is Kind.INT and expr_kind(parse_expr("~c"), ctx) is Kind.BOOL
    assert is_nonneg(bits, ctx) and is_nonneg(parse_expr("d & 7"), ctx) and not is_nonneg(parse_expr("d | 7"), ctx)
    assert ival(parse_expr("d & 7"), {}, {}) == (0, 7) and ival(parse_expr("(d < 1) | (d > 4)"), {}, {}) == (0, 1)
    assert ival(parse_expr("q_idx >> 2"), {"q_idx": (0, 100)}, {}) == (0, 25)
    # Triton: & | << >> as written; ~ of an integer is ~, of a boolean (x == 0) as before
    assert lower_expr(bits, ctx) == "((q_idx >> 1) & 51)"
    assert lower_expr(parse_expr("~d + ~c"), ctx) == "((~d) + (c == 0))"
    assert lower_expr(parse_expr("erf(x)"), ctx) == "tl.erf(x)"
    assert lower_expr(parse_expr("erf(x)"), _ctx(ExprTarget.HOST)) == "_hfloat(torch.erf)(x)"
    # CUDA: bitwise on integers, && || ! on booleans
    assert lower_cexpr(bits, ctx) == "((q_idx >> 1LL) & 51LL)"
    assert lower_cexpr(logic, ctx) == "(c && (d > 0LL))"
    assert lower_cexpr(parse_expr("~d | c"), ctx) == "((~d) | ((long long)(c)))"
    assert lower_cexpr(parse_expr("erf(x)"), ctx) == "erff(x)"


_DECODE = "(q_idx & 1431655765 | (q_idx & 1431655765) >> 1) & 858993459"  # Morton: x's bits, first step


def test_triton_interpreter_runs_bits_bool_table_and_erf(tmp_path: Path) -> None:
    mask = f"({_DECODE}) >> 1 <= (kv_idx & 1431655765) | glob[kv_idx] | glob[q_idx]"
    score = "score * 0.5 * (1.0 + erf(score * 0.7071067811865476))"
    p = forward("bits", score_mod=score, mask_mod=mask, aux=(Param("glob", ("N",), Dtype.BOOL, Role.AUX),))
    g = torch.Generator().manual_seed(0)
    B, H, M, D = 2, 2, 37, 16
    qkv = {n: torch.randn(B, H, M, D, generator=g) for n in "qkv"}
    glob = torch.zeros(M, dtype=torch.bool)
    glob[::9] = True
    out = TritonKernel.from_program(p, tmp_path).run({**qkv, "glob": glob})
    o_ref, lse_ref = reference_attention(p, qkv["q"], qkv["k"], qkv["v"], aux={"glob": glob})
    torch.testing.assert_close(out["o"].float(), o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["lse"], lse_ref, atol=1e-4, rtol=1e-4)
