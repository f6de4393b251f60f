"""Backward programs in the IR: text round trip, validation, symbolic derivatives, and the
interpreter's dq, dk, dv (and a learnable table's gradient) against torch autograd."""

from __future__ import annotations

import math

import pytest
import torch

from kb.errors import KBError
from kb.ir.derive import aux_partials, score_grad
from kb.ir.expr import parse_expr, print_expr
from kb.ir.interpret import run_program
from kb.ir.nodes import is_backward
from kb.ir.text import parse_program, print_program
from kb.ir.validate import problems
from tests.support.ir_programs import backward_text

def _reference(q, k, v, scale, score_fn, mask_fn):
    """fp32 dense attention; fully masked rows give o = 0 and lse = -inf."""
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = scale * q @ kk.transpose(-1, -2)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(Hq).view(1, Hq, 1, 1)
    qi, ki = torch.arange(M).view(1, 1, M, 1), torch.arange(N).view(1, 1, 1, N)
    if score_fn is not None:
        s = score_fn(s, b, h, qi, ki)
    allowed = torch.ones_like(s, dtype=torch.bool) if mask_fn is None else mask_fn(b, h, qi, ki).expand(s.shape)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ vv, lse


CASES = {
    "plain": dict(),
    "causal": dict(mask_mod="q_idx >= kv_idx", m_lo="n_start // BLOCK_M * BLOCK_M",
                   mask_fn=lambda b, h, q, k: q >= k),
    "gqa_causal": dict(mask_mod="q_idx >= kv_idx", mask_fn=lambda b, h, q, k: q >= k, hkv=1),
    "sliding_window": dict(mask_mod="(q_idx >= kv_idx) & (q_idx - kv_idx <= 10)",
                           mask_fn=lambda b, h, q, k: (q >= k) & (q - k <= 10)),
    "empty_rows": dict(mask_mod="kv_idx + 3 <= q_idx", mask_fn=lambda b, h, q, k: k + 3 <= q),
    "softcap": dict(score_mod="softcap * tanh(score / softcap)", scalars={"softcap": 2.0},
                    score_fn=lambda s, b, h, q, k: 2.0 * torch.tanh(s / 2.0)),
    "alibi": dict(score_mod="score + slopes[h] * (kv_idx - q_idx)", mask_mod="q_idx >= kv_idx",
                  aux={"slopes": torch.tensor([0.5, 0.25])}, extra="param slopes: [Hq] f32 aux\n",
                  mask_fn=lambda b, h, q, k: q >= k),
}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _run_case(name: str, case: dict, *, B: int = 1, Hq: int = 2, M: int = 40, N: int = 40, D: int = 8):
    hkv = case.get("hkv", Hq)
    text = backward_text(name, score_mod=case.get("score_mod"), mask_mod=case.get("mask_mod"),
                         extra=case.get("extra", "") + "".join(f"param {s}: [] f32 scalar\n" for s in case.get("scalars", {})),
                         aux_grad=case.get("aux_grad"), m_lo=case.get("m_lo", "0"))
    prog = parse_program(text)
    q = torch.randn(B, Hq, M, D, requires_grad=True)
    k = torch.randn(B, hkv, N, D, requires_grad=True)
    v = torch.randn(B, hkv, N, D, requires_grad=True)
    aux = {n: t.clone().requires_grad_(True) for n, t in case.get("aux", {}).items()}
    scale = 1 / math.sqrt(D)
    score_fn = case.get("score_fn")
    if "slopes" in aux:
        score_fn = lambda s, b, h, qi, ki: s + aux["slopes"][h] * (ki - qi)  # noqa: E731
    if "rel" in aux:
        score_fn = lambda s, b, h, qi, ki: s + aux["rel"][h, qi - ki + N - 1]  # noqa: E731
    if "score_fn_of" in case:  # a score function reading the (differentiable) aux tensors
        score_fn = case["score_fn_of"](aux)
    o, lse = _reference(q, k, v, scale, score_fn, case.get("mask_fn"))
    dout = torch.randn_like(o)
    o.backward(dout)
    out = run_program(prog, {"q": q.detach(), "k": k.detach(), "v": v.detach(), "o": o.detach(), "dout": dout,
                             "lse": lse.detach(), "sm_scale": scale, **case.get("scalars", {}),
                             **{n: t.detach() for n, t in aux.items()}})
    return out, {"dq": q.grad, "dk": k.grad, "dv": v.grad, **{"d" + n: t.grad for n, t in aux.items()}}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_match_autograd(name: str) -> None:
    out, want = _run_case(name, CASES[name])
    for g in ("dq", "dk", "dv"):
        torch.testing.assert_close(out[g], want[g], atol=1e-4, rtol=1e-4, msg=lambda m: f"{name} {g}: {m}")


def test_learnable_table_gets_its_gradient() -> None:
    N = 24
    case = dict(score_mod="score + rel[h, q_idx - kv_idx + N - 1]", aux={"rel": 0.3 * torch.randn(2, 2 * N - 1)},
                extra="param rel: [Hq, R] f32 aux\nparam drel: [Hq, R] f32 out\n", aux_grad="drel of rel")
    out, want = _run_case("rel_bias", case, M=N, N=N)
    for g in ("dq", "dk", "dv", "drel"):
        torch.testing.assert_close(out[g], want[g], atol=1e-4, rtol=1e-4)


def _t5_bucket(d: torch.Tensor) -> torch.Tensor:
    """Log-spaced buckets of |d| (T5): 0..3 exact, then 4 + trunc(log(|d| / 4) / log(6) * 4), at most 7; the upper
    half for d < 0."""
    n = d.abs()
    far = torch.clamp(4 + (torch.log(n.clamp(min=1).float() / 4) / math.log(6.0) * 4).to(torch.int64), max=7)
    return (d < 0).to(torch.int64) * 8 + torch.where(n < 4, n, far)


def test_bucketed_table_gets_its_gradient() -> None:
    """A table read at trunc(log(...))-computed buckets: trunc is piecewise constant, the table's partial is 1, and
    the gradient of each bucket sums over every (q, kv) pair that reads it."""
    case = dict(score_mod="score + tab[h, where(kv_idx - q_idx < 0, 8, 0) + where(abs(kv_idx - q_idx) < 4, "
                          "abs(kv_idx - q_idx), minimum(4 + trunc(log(maximum(abs(kv_idx - q_idx), 1) / 4) "
                          f"/ {math.log(6.0)!r} * 4), 7))]",
                aux={"tab": 0.5 * torch.randn(2, 16)}, extra="param tab: [Hq, 16] f32 aux\nparam dtab: [Hq, 16] f32 out\n",
                aux_grad="dtab of tab",
                score_fn_of=lambda aux: lambda s, b, h, qi, ki: s + aux["tab"][h, _t5_bucket(ki - qi)])
    out, want = _run_case("t5_buckets", case)
    for g in ("dq", "dk", "dv", "dtab"):
        torch.testing.assert_close(out[g], want[g], atol=1e-4, rtol=1e-4)


def test_text_round_trips_and_validates() -> None:
    text = backward_text("causal_bwd", mask_mod="q_idx >= kv_idx")
    p = parse_program(text)
    assert print_program(p) == text
    assert problems(p) == ()
    assert is_backward(p)
    assert "dot dvp = trans(p) @ gt" in text and "store dq_acc[b, h, m_start:+BLOCK_M, :] += dqp" in text


def test_validator_names_bad_backward_statements() -> None:
    text = backward_text("bad", extra="param rel: [Hq, R] f32 aux\nparam drel: [Hq, R] bf16 out\n",
                         aux_grad="drel of rel").replace("softmax_grad ds = p * (dp - dt)", "softmax_grad ds = p * (dp - kt)")
    found = [str(x) for x in problems(parse_program(text))]
    assert any("'drel' must be an f32 out param" in f for f in found)
    assert any("score_mod does not read 'rel'" in f for f in found)
    assert any("'kt'" in f and "row vector" in f for f in found)


def test_parse_error_names_the_backward_form() -> None:
    with pytest.raises(KBError, match="probs P = exp"):
        parse_program(backward_text("x").replace("probs p = exp(sm - lt)", "probs p = sm - lt"))


def test_derivatives_of_variant_expressions() -> None:
    assert print_expr(score_grad(parse_expr("score + slopes[h] * (kv_idx - q_idx)"))) == "1"
    assert print_expr(score_grad(parse_expr("where(q_idx >= kv_idx, score, -inf)"))) == "where(q_idx >= kv_idx, 1, 0)"
    g = score_grad(parse_expr("softcap * tanh(score / softcap)"))
    assert "tanh(score / softcap)" in print_expr(g)
    (idx, partial), = aux_partials(parse_expr("score * temp[h] + rel[h, q_idx - kv_idx]"), "temp")
    assert [print_expr(i) for i in idx] == ["h"] and print_expr(partial) == "score"
