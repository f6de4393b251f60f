"""The backward half of a verification session (`backward=True`), mixed into `verify.session.Session`.

After a call whose forward passed, `_check_backward` differentiates the candidate's output once
with `torch.autograd.grad(out, [q, k, v, *params], dO)` under the CallGuard (phase "backward"):
- dO: a fresh N(0, 1) cotangent per call (from the call's seed), cast to the output's dtype; the
  references get that cast value, so dO's rounding is shared as the inputs' is;
- the reference gradients (fp64 for an fp32 spec) and the same-dtype torch error (verify.grads);
- ModelNew's parameters named like Model's learnable ones (their values were copied by name);
- per gradient: present, not aliasing the inputs/output/dO, not written into the previous call's
  gradient buffer (held, so its memory cannot be handed out again), not the previous call's value
  for different inputs, finite and within the tolerance of verify.grads.
Before the backward the allocator is poisoned with NaN buffers of each gradient's size. Gradients are
not checked for bitwise determinism: a dq accumulated with atomics legitimately differs in its last
bits from run to run.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from verify.checks import identity_problem, storage_ptrs
from verify.context import Ctx
from verify.grads import (GRAD_SLACK, GradTargets, compare_grad, cotangent, grad_scale, model_grads, rounded,
                          torch_error)
from verify.guard import CallGuard
from verify.load import Spec, SpecError
from verify.memory import poison_allocator
from verify.options import VerifyOptions
from verify.result import BackwardReport, Finding, Verdict

__all__ = ["BackwardChecks"]


class BackwardChecks:
    """Mixin for Session: needs its spec, opts, device, ref_model, cand, targets, _finding, _error,
    _progress, _expected_dtype, and the counters set in Session.__init__."""

    # set by Session (verify.session) before any method here runs
    spec: Spec
    opts: VerifyOptions
    device: str
    ref_model: torch.nn.Module
    cand: torch.nn.Module
    targets: GradTargets
    bwd_calls: int
    grad_err: float
    torch_err: float
    _last_grads: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    if TYPE_CHECKING:  # Session's methods, declared for the checker only
        def _progress(self, ctx: Ctx) -> None: ...
        def _finding(self, verdict: Verdict, message: str, ctx: Ctx, **kw: Any) -> Finding: ...
        def _error(self, err: BaseException, ctx: Ctx, what: str = "", phase: str = "forward") -> Finding: ...
        def _expected_dtype(self) -> torch.dtype: ...

    def _leaves(self, inputs: list[Any]) -> list[Any]:
        """With `backward`, the differentiated inputs become leaves that require grad (in place: fresh tensors)."""
        if self.opts.backward:
            for i in self.targets.positions:
                inputs[i].requires_grad_(True)
        return inputs

    def _check_backward(self, out: torch.Tensor, inputs: list[Any], ctx: Ctx) -> Finding | None:
        """One guarded backward of the candidate's output against the fp32 reference gradients."""
        self._progress(ctx)
        if not out.requires_grad or out.grad_fn is None:
            return self._finding(Verdict.no_backward, "the candidate has no backward: its output does not require "
                                 "grad (no grad_fn: detached, or computed outside autograd)", ctx, phase="backward")
        d_cast = cotangent(out.shape, ctx.seed, self.device).to(out.dtype)
        ref, torch_errs = self._reference_grads(inputs, d_cast.float())  # dO's rounding is shared, as the inputs'
        wrt, finding = self._candidate_params(ctx)
        if finding:
            return finding
        grads, finding = self._candidate_grads(out, [inputs[i] for i in self.targets.positions] + wrt, d_cast, ctx)
        if finding:
            return finding
        self.bwd_calls += 1
        avoid = storage_ptrs([*inputs, out, d_cast])
        key = (tuple(out.shape), ctx.case)
        for label, got, want, e_torch in zip(self.targets.labels, grads, ref, torch_errs):
            finding = self._check_grad(label, got, want, e_torch, avoid, key, ctx)
            if finding:
                return finding
        return None

    def _reference_grads(self, inputs: list[Any], d_out: torch.Tensor) -> tuple[list[Any], list[float]]:
        """Reference gradients (fp64 for an fp32 spec, else fp32) and, per gradient, how far torch's own gradients in
        the spec's dtype are from them."""
        dtype = self._expected_dtype()
        try:
            if dtype == torch.float32:
                ref = model_grads(self.ref_model, inputs, self.targets, d_out, emulate=torch.float64)
                lowp = model_grads(self.ref_model, inputs, self.targets, d_out)
            else:
                ref = model_grads(self.ref_model, inputs, self.targets, d_out)
                lowp = model_grads(self.ref_model, inputs, self.targets, d_out, emulate=dtype, truncate=self._interpreted())
        except Exception as err:
            raise SpecError(f"the spec's Model has no usable backward: {type(err).__name__}: {err}") from err
        # torch's own gradient of a leaf comes in the leaf's dtype (a bf16 q's dq is bf16, whatever the spec computes in)
        leaf = [inputs[i].dtype for i in self.targets.positions] + [None] * len(self.targets.params)
        lowp = [g if g is None or dt is None else rounded(g, dt, self._interpreted()) for g, dt in zip(lowp, leaf)]
        errs = [torch_error(lo, r) for lo, r in zip(lowp, ref)]
        self.torch_err = max([self.torch_err] + [e / grad_scale(r) for e, r in zip(errs, ref) if r is not None])
        return ref, errs

    def _interpreted(self) -> bool:
        """Triton kernels run by the interpreter (CPU), whose fp32 -> bf16 conversion truncates."""
        return self.device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"

    def _candidate_params(self, ctx: Ctx) -> tuple[list[torch.Tensor], Finding | None]:
        """ModelNew's parameters named like Model's learnable ones (their state was copied by name)."""
        mine = dict(self.cand.named_parameters())
        for name in self.targets.params:
            p = mine.get(name)
            if p is None or not p.requires_grad:
                why = "has no nn.Parameter" if p is None else "has a parameter that does not require grad"
                return [], self._finding(Verdict.no_backward, f"the candidate has no backward for Model's learnable "
                                         f"parameter {name!r}: ModelNew {why} of that name", ctx, phase="backward",
                                         grad=f"param {name}")
        return [mine[n] for n in self.targets.params], None

    def _candidate_grads(self, out: torch.Tensor, wrt: list[torch.Tensor], d_cast: torch.Tensor,
                         ctx: Ctx) -> tuple[list[torch.Tensor | None], Finding | None]:
        """The harness's one autograd call on the candidate's output, guarded (verify.guard, phase backward)."""
        for size in sorted({t.numel() * t.element_size() for t in wrt}):
            poison_allocator(size, self.device)
        guard = CallGuard(not self.opts.torch_baseline, str(self.spec.path), [*wrt, d_cast], out.numel(), phase="backward")
        grads: list[torch.Tensor | None] = []
        error = None
        try:
            with guard:
                grads = list(torch.autograd.grad(out, wrt, d_cast, allow_unused=True))
                if self.device == "cuda":
                    torch.cuda.synchronize()
        except Exception as err:
            error = err
        if guard.violation:
            v = guard.violation
            return grads, self._finding(v.verdict, v.message, ctx, op=v.op, phase="backward")
        if isinstance(error, NotImplementedError):
            return grads, self._finding(Verdict.no_backward, f"the candidate has no backward: {str(error)[:300]}", ctx,
                                        phase="backward")
        if error is not None:
            return grads, self._error(error, ctx, what="backward raised ", phase="backward")
        return grads, None

    def _check_grad(self, label: str, got: torch.Tensor | None, want: torch.Tensor | None, e_torch: float,
                    avoid: set[int], key: tuple[Any, ...], ctx: Ctx) -> Finding | None:
        kw: dict[str, Any] = dict(phase="backward", grad=label)
        if want is None:  # the spec's output does not depend on it
            return None
        if got is None:
            if not bool(want.abs().gt(0).any()):
                return None
            return self._finding(Verdict.no_backward, f"the candidate's backward gives no gradient for {label} (None)", ctx, **kw)
        problem = identity_problem(got, avoid, what=f"gradient {label}")
        if problem:
            return self._finding(Verdict.hack_suspected, problem[1], ctx, op=problem[0], **kw)
        if got.shape != want.shape:  # a parameter of Model's name but another shape (its values were not copied)
            return self._finding(Verdict.shape_mismatch, f"gradient {label} has shape {tuple(got.shape)}, the reference's "
                                 f"is {tuple(want.shape)}", ctx, **kw)
        prev = self._last_grads.get((*key, label))
        self._last_grads[(*key, label)] = (got, got.detach().clone(), want)
        if prev is not None and got.untyped_storage().data_ptr() == prev[0].untyped_storage().data_ptr():
            return self._finding(Verdict.hack_suspected, f"gradient {label} is written into the previous call's gradient "
                                 "buffer (results must not be reused across calls)", ctx, op="reused_grad_buffer", **kw)
        if prev is not None and bool(prev[1].ne(0).any()) and torch.equal(prev[1], got) \
                and not torch.allclose(prev[2], want, equal_nan=True):
            return self._finding(Verdict.hack_suspected, f"gradient {label} repeats the previous call's for different "
                                 "inputs (result cached across calls)", ctx, op="cached_grad", **kw)
        cmp = compare_grad(got, want, e_torch, self._expected_dtype())
        self.grad_err = max(self.grad_err, cmp.max_abs_err)
        if not cmp.ok:
            what = f"{cmp.nonfinite} NaN/Inf where the reference is finite; " if cmp.nonfinite else ""
            return self._finding(Verdict.numeric_mismatch, f"gradient {label}: {what}{cmp.bad_elements} elements out of "
                                 f"tolerance, first at {cmp.first_bad}", ctx, max_abs_err=cmp.max_abs_err,
                                 max_rel_err=cmp.max_rel_err, **kw)
        return None

    def backward_report(self) -> BackwardReport | None:
        if not self.opts.backward:
            return None
        return BackwardReport(calls=self.bwd_calls, grads=self.targets.labels, max_abs_err=self.grad_err,
                              max_torch_err=self.torch_err, slack=GRAD_SLACK)
