"""The IR check of a backward program: interpreted gradients against autograd of the spec's variant.

The forward program runs first (in the interpreter, on the spec's inputs) to give o and lse, as the
generated kernel's forward saves them; the backward program then runs on a random dO. The reference
is fp32 dense attention over the spec's traced score_mod/mask_mod (`variants_attention`'s math, which
tracing already checked against the spec's own Model), differentiated by torch autograd, including
the learnable aux tables. The kernel itself is checked later against the user's Model (verify/).

Tolerance: the forward's IR tolerance for the dtype, plus `verify.grads.GRAD_SLACK` times the error of
the same reference computed as eager torch in the spec's dtype (`verify.grads.DtypeEmulation`): the
program reads o as the operator saves it (fp32, see kb.lower.triton_op), and a gradient that sums many
products (a bias table's, over every pair of a bucket) carries that rounding, as eager torch's does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch

from generate.attempts import IR_CHECK_TOL
from generate.spec import Spec, spec_inputs, variants_attention
from kb.errors import KBError
from kb.ir.interpret import run_program
from kb.ir.nodes import Program, Role, aux_gradients
from verify.grads import GRAD_SLACK, DtypeEmulation, torch_error

__all__ = ["check_backward_program", "reference_grads"]


def reference_grads(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    grads: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """dq, dk, dv (and, for each `grads` entry aux -> name, the aux's gradient under that name) of fp32 dense
    attention with the spec's variant."""
    grads = grads or {}
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    aux = {n: t.detach().float().requires_grad_(n in grads) if t.is_floating_point() else t
           for n, t in spec.aux.items()}
    variants_attention(spec, qf, kf, vf, aux).backward(dout.float())
    out: dict[str, torch.Tensor] = {}
    for name, t in (("dq", qf), ("dk", kf), ("dv", vf)):
        grad = t.grad
        assert grad is not None  # q, k and v all reach the output
        out[name] = grad
    for n, g in grads.items():
        grad = aux[n].grad
        out[g] = grad if grad is not None else torch.zeros_like(aux[n])
    return out


def _in_dtype(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
              grads: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The reference gradients as eager torch computes them in the spec's dtype (none for fp32 specs)."""
    if q.dtype == torch.float32:
        return {}
    with DtypeEmulation(q.dtype):
        return reference_grads(spec, q, k, v, dout, grads)


def _o_as_read(forward: Program, backward: Program) -> Program:
    """The forward writing o in the dtype the backward reads it (fp32: the operator saves the forward's fp32 O)."""
    want = backward.param("o").dtype
    if forward.param("o").dtype is want:
        return forward
    return replace(forward, params=tuple(replace(p, dtype=want) if p.name == "o" else p for p in forward.params))


def check_backward_program(backward: Program, forward: Program, spec: Spec, learnable: tuple[str, ...] = (),
                           seed: int = 0) -> str | None:
    """None when the interpreted gradients match autograd within the dtype's IR tolerance; else why not.
    `learnable`: the aux tensors whose gradients the program must produce (its `aux_grad` targets name them)."""
    produced = {aux: g for g, aux in aux_gradients(backward).items()}
    missing = [a for a in learnable if a not in produced]
    if missing:
        return f"backward program does not produce the gradient of {', '.join(missing)}"
    grads = {a: produced[a] for a in learnable}
    q, k, v = spec_inputs(spec, seed)
    inputs: dict = {"q": q, "k": k, "v": v, "sm_scale": spec.softmax_scale}
    for p in forward.params:
        if p.role is Role.AUX:
            inputs[p.name] = spec.aux[p.name]
    try:
        saved = run_program(_o_as_read(forward, backward), inputs)
        dout = torch.randn(saved["o"].shape, generator=torch.Generator().manual_seed(seed + 1)).to(q.dtype)
        got = run_program(backward, {**inputs, "o": saved["o"], "lse": saved["lse"], "dout": dout})
    except KBError as err:
        return f"interpreter error: {err}"
    want = reference_grads(spec, q, k, v, dout, grads)
    lowp = _in_dtype(spec, q, k, v, dout, grads)
    tol = IR_CHECK_TOL.get(spec.shapes.dtype, 1e-4)
    for name, ref in want.items():
        out = got.get(name)
        if out is None:
            return f"backward program does not produce {name}"
        if out.shape != ref.shape:
            return f"{name} shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
        abs_err = (out.float() - ref).abs().nan_to_num(float("inf"))
        bound = tol * max(1.0, ref.abs().max().item()) + GRAD_SLACK * torch_error(lowp.get(name), ref)
        if abs_err.max().item() > bound:
            at = tuple((abs_err == abs_err.max()).nonzero()[0].tolist())
            return (f"IR gradient {name} differs from autograd of the spec: max abs err {abs_err.max().item():.3g} "
                    f"(tolerance {bound:.3g}) first at {at}")
    return None
