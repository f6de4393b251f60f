"""Learnable scalars in the backward (issue #29, item 7): a temperature that multiplies or divides every score, one
per head, and a bias added to every score get their gradients, whatever the parameter is called.

Each spec of tests/data/specs is transferred into FA2's backward structure, checked in the IR interpreter against
autograd, lowered with its forward into a KernelBench candidate and differentiated on CPU (Triton's interpreter).
A temperature's gradient is the sum of dS * s over every pair and head: its aux_grad is centred on the row's lse
(kb.ir.derive.row_centre), and the verifier's reference for an fp32 spec is the Model in fp64 (verify.grads).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from generate.candidate import write_candidate
from generate.check_backward import check_backward_program
from generate.spec import load_spec
from generate.target import target_for
from generate.transfer import Strategy, transfer
from generate.transfer_bwd import backward_target, transfer_backward
from kb.ir.derive import ROW_LSE, aux_partials, row_centre
from kb.ir.expr import parse_expr, print_expr
from kb.ir.interpret import run_program
from kb.ir.nodes import AuxGrad, Role, aux_gradients, walk_stmts
from kb.ir.rename import names
from kb.ir.text import parse_program, print_program
from kb.ir.validate import validate
from kb.lower.triton_bwd import lower_autograd
from tests.support.backward import GOLDEN, REFERENCE, SPECS, transferred_programs
from verify.grads import GradTargets, grad_targets, model_grads
from verify.inputs import _draw
from verify.shapes import find_layout

SCALARS = {  # case -> spec file in tests/data/specs
    "temperature": "temperature_learnable.py",  # s * self.t, fp32, causal
    "divisor_bf16": "temperature_divisor_bf16.py",  # s / self.temperature, bf16
    "per_head_gqa": "temperature_per_head_gqa.py",  # s * self.temperature[h], GQA 4/2, causal
    "bias": "bias_scalar_learnable.py",  # s + self.bias: zero gradient
}


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


# ------------------------------------------------------------------ the derivative and its row centre


@pytest.mark.parametrize("body, aux, partial, centre", [
    ("score * t[0]", "t", "score", f"where(t[0] != 0, 1 / t[0], 0) * {ROW_LSE}"),
    ("score * t[h]", "t", "score", f"where(t[h] != 0, 1 / t[h], 0) * {ROW_LSE}"),
    ("score / T[0]", "T", "-(score / (T[0] * T[0]))",
     f"where(1 / T[0] != 0, -(1 / (T[0] * T[0])) / (1 / T[0]), 0) * {ROW_LSE}"),
    ("score + c[0]", "c", "1", "1"),  # the centred partial is 0: a bias on every score has no gradient
    ("score * t[0] + c[0]", "t", "score", f"where(t[0] != 0, 1 / t[0], 0) * ({ROW_LSE} - c[0])"),
    ("score + kb[kv_idx]", "kb", "1", None),  # one entry per key: nothing shared along a row
    ("score + slopes[h] * (kv_idx - q_idx)", "slopes", "kv_idx - q_idx", None),
    ("c[0] * tanh(score / c[0])", "c", None, None),  # not affine in score: no centre
])
def test_row_centre(body: str, aux: str, partial: str | None, centre: str | None) -> None:
    (index, got), = aux_partials(parse_expr(body), aux)
    if partial is not None:
        assert print_expr(got) == partial
    c = row_centre(parse_expr(body), index, got)
    assert (None if c is None else print_expr(c)) == centre


# ------------------------------------------------------------------ names


NAMES = ("t", "q", "lse", "delta", "s", "p", "dt", "ds", "sm", "lt", "kt", "m_start", "o", "dq", "acc", "ef")


def _renamed_spec(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"temp_{name}.py"
    path.write_text(re.sub(r"self\.t\b", f"self.{name}", (SPECS / SCALARS["temperature"]).read_text()))
    return path


@pytest.mark.parametrize("name", NAMES)
def test_gradient_and_aux_names_never_collide(tmp_path: Path, name: str) -> None:
    """A temperature of any name: the forward and backward programs validate, and the gradient param takes no name
    of the reference or the forward (the issue's `t`: its `dt` is FA2's delta tile)."""
    spec = load_spec(_renamed_spec(tmp_path, name))
    fwd = transfer(parse_program((GOLDEN / "causal.kbir").read_text()), target_for(spec), Strategy.BLOCK_MASK, name="fwd")
    validate(fwd)
    (aux,) = [p.name for p in fwd.params if p.role is Role.AUX]
    assert aux not in {"q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv"}  # spec tracing keeps interface names
    bwd = transfer_backward(REFERENCE, backward_target(fwd, (aux,), (spec.shapes.M, spec.shapes.N)), name="bwd")
    validate(bwd)
    (grad,) = aux_gradients(bwd)
    assert aux_gradients(bwd)[grad] == aux and grad not in names(REFERENCE) | names(fwd)
    assert parse_program(print_program(bwd)) == bwd


@pytest.mark.parametrize("name", ["s", "delta"])
def test_a_renamed_reference_keeps_its_meaning(tmp_path: Path, name: str) -> None:
    """An aux tensor named like FA2's score tile (`s`) or delta buffer: the reference's own is renamed, and the
    interpreted gradients still match autograd."""
    spec = load_spec(_renamed_spec(tmp_path, name))
    fwd = transfer(parse_program((GOLDEN / "causal.kbir").read_text()), target_for(spec), Strategy.BLOCK_MASK, name="fwd")
    target = backward_target(fwd, (name,), (spec.shapes.M, spec.shapes.N))
    bwd = transfer_backward(REFERENCE, target, name="bwd")
    assert check_backward_program(bwd, fwd, spec, target.learnable) is None


# ------------------------------------------------------------------ transfer, IR check, lowered candidate


@pytest.mark.parametrize("case", sorted(SCALARS))
def test_transferred_backward_matches_autograd(case: str) -> None:
    spec, fwd, bwd, target = transferred_programs(SCALARS[case])
    (aux,) = target.learnable
    grads = [st for k in bwd.kernels for st in walk_stmts(k.body) if isinstance(st, AuxGrad)]
    assert len(grads) == 1 and grads[0].aux == aux and grads[0].lse is not None, "a scalar's aux_grad is centred"
    assert check_backward_program(bwd, fwd, spec, target.learnable) is None


@pytest.mark.parametrize("case", sorted(SCALARS))
def test_learnable_scalar_trains_through_the_candidate(case: str, tmp_path: Path) -> None:
    """kb generate's path: the backward lowered with its forward, written as ModelNew; q, k, v and the scalar's
    gradients match the spec's Model (inputs in fp32, as test_lower_triton_bwd does for the variant classes)."""
    spec, fwd, bwd, _ = transferred_programs(SCALARS[case])
    aux = [q.name for q in fwd.params if q.role is Role.AUX]
    files = write_candidate(spec, lower_autograd(fwd, bwd), aux, tmp_path, case)
    spec_mod, cand = _import(SPECS / SCALARS[case]), _import(files.candidate)
    torch.manual_seed(0)
    model, new = spec_mod.Model(*spec_mod.get_init_inputs()), cand.ModelNew(*spec_mod.get_init_inputs())
    new.load_state_dict(model.state_dict())
    ins = [t.float().requires_grad_() for t in spec_mod.get_inputs()]
    ref = [t.detach().clone().requires_grad_() for t in ins]
    out = new(*ins)
    dout = torch.randn_like(out)
    out.backward(dout)
    model(*ref).backward(dout)
    for got, want in zip(ins, ref):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-4, rtol=1e-4)
    (name, got), = new.named_parameters()
    want = dict(model.named_parameters())[name].grad
    assert got.grad is not None and got.grad.shape == want.shape and torch.isfinite(got.grad).all()
    if case == "bias":  # softmax is shift invariant: exactly zero, where autograd gives fp32 noise
        assert torch.equal(got.grad, torch.zeros_like(want)) and want.abs().max() < 1e-4
    else:
        torch.testing.assert_close(got.grad, want, atol=1e-4, rtol=1e-4)


def test_a_bias_on_every_score_gets_zero_in_the_ir_too() -> None:
    spec, fwd, bwd, _ = transferred_programs(SCALARS["bias"])
    q, k, v = (torch.randn(2, 2, 40, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ins = {"q": q, "k": k, "v": v, "sm_scale": spec.softmax_scale, "bias": spec.aux["bias"]}
    saved = run_program(fwd, ins)
    got = run_program(bwd, {**ins, "o": saved["o"], "lse": saved["lse"], "dout": torch.randn(q.shape)})
    (grad,) = aux_gradients(bwd)
    assert torch.equal(got[grad], torch.zeros(1))


# ------------------------------------------------------------------ the verifier's reference for such a sum


def test_fp32_gradient_reference_is_computed_in_fp64() -> None:
    """A temperature's gradient on the adversarial distribution cancels to ~1e-4 and fp32 eager torch is ~60% off
    it: the reference is the Model in fp64 (every op widened, a spec's own `.float()` included), and e_torch measures
    fp32 torch's distance from it."""
    spec = _import(SPECS / SCALARS["temperature"])
    model = spec.Model()
    g = torch.Generator().manual_seed(0)
    ins = [_draw((1, 2, 70, 32), "adversarial", role, g) for role in "qkv"]
    dout = torch.randn(1, 2, 70, 32, generator=g)
    targets = grad_targets(find_layout(ins), ins, model)
    ref = model_grads(model, ins, targets, dout, emulate=torch.float64)
    fp32 = model_grads(model, ins, targets, dout)
    double = model.double()
    leaves = [x.double().requires_grad_() for x in ins]
    exact = torch.autograd.grad(double(*leaves), [*leaves, double.t], dout.double())
    assert all(r.dtype == torch.float64 for r in ref)
    torch.testing.assert_close(ref[-1], exact[-1], atol=1e-12, rtol=1e-9)
    assert (fp32[-1] - ref[-1]).abs().item() > 0.2 * ref[-1].abs().item()  # fp32 is far off: the sum cancels


def test_fp64_reference_widens_a_specs_own_fp32_casts() -> None:
    class CastsToFp32(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = torch.nn.Parameter(torch.tensor(0.7))
            self.table = torch.arange(8.0)  # a plain fp32 attribute: never converted by .double()

        def forward(self, q, k, v):
            s = q.float() @ k.float().transpose(-1, -2) * self.t + self.table
            return torch.softmax(s, -1) @ v.float()

    q, k, v = (torch.randn(1, 1, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    grads = model_grads(CastsToFp32(), [q, k, v], GradTargets((0, 1, 2), ("q", "k", "v"), ("t",)), torch.randn(1, 1, 8, 4),
                        emulate=torch.float64)
    assert all(x is not None and x.dtype == torch.float64 for x in grads)
