"""One verification session in the child: every (shape, distribution) call and its checks.

Per shape case, for the first distribution the candidate is called three times:
1. on fresh inputs X;
2. on the same storage overwritten in place with new values X' (a result cached by
   data_ptr or shape comes back unchanged and is caught as hack_suspected);
3. on fresh-storage clones of X' (must be bitwise equal to call 2: determinism).
Every other distribution gets one call on fresh inputs. Before each call the allocator
is poisoned with NaN buffers and the reference output is kept alive, so a candidate that
returns uninitialised memory sees NaN or zeros, never a previous answer.

With `backward=True` q, k, v require grad, ModelNew runs with grad enabled, and every call whose
forward passes is followed by a guarded backward (`_check_backward`): a fresh dO per call, the
candidate's gradients of q, k, v and of Model's learnable parameters against the fp32 reference
with the tolerance of verify.grads; missing autograd, missing gradients, gradients aliasing the
inputs or a previous call's buffers, and gradients repeated from the previous call for different
inputs are caught. Gradients are not checked for bitwise determinism (a dq accumulated with
atomics legitimately differs in its last bits from run to run).
"""

from __future__ import annotations

import copy
import logging
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from dataclasses import replace
from typing import Any

import torch

from verify.checks import compare, identity_problem, storage_ptrs
from verify.grads import GRAD_SLACK, cotangent, compare_grad, grad_scale, grad_targets, model_grads, torch_error
from verify.guard import CallGuard
from verify.inputs import make_inputs
from verify.load import Spec, SpecError
from verify.memory import measure_peak
from verify.options import VerifyOptions
from verify.reference import reference_output, tf32
from verify.result import BackwardReport, Finding, MemoryReport, ShapeCase, TimingReport, Verdict, VerifyResult
from verify.shapes import Layout, find_layout, plan_cases
from verify.timing import attention_bytes, attention_flops, composite_score, perf_term, roofline_ms, time_fn

__all__ = ["Session"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Ctx:
    case: ShapeCase | None
    dist: str
    seed: int
    step: str


def poison_allocator(nbytes: int, device: str) -> None:
    """Allocate, NaN-fill and free buffers of the output's size so `torch.empty` hands back NaN."""
    for n in (nbytes, 2 * nbytes, nbytes + 4096):
        buf = torch.full((max(1, n // 4),), float("nan"), device=device)
        del buf


class Session:
    def __init__(self, spec: Spec, cand_cls: type, opts: VerifyOptions, device: str, seed: int, progress: Path | None) -> None:
        self.spec, self.opts, self.device, self.seed, self.progress = spec, opts, device, seed, progress
        self.calls, self.max_abs, self.max_rel = 0, 0.0, 0.0
        self.cand_peak, self.ref_peak, self.mem_method = 0.0, 0.0, ""
        self.cases_run: list[ShapeCase] = []
        self.notes: list[str] = []
        torch.manual_seed(seed)
        init = list(spec.get_init_inputs())
        self.native_model = spec.model_cls(*init).to(device).eval()
        # the fp32 reference is the same model (same random weights), not a second draw
        self.ref_model = copy.deepcopy(self.native_model).float().eval()
        torch.manual_seed(seed)
        self.cand_cls, self.init = cand_cls, init
        self.own_inputs = list(spec.get_inputs())
        self.layout: Layout = find_layout(self.own_inputs)
        self._last: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.targets = grad_targets(self.layout, self.own_inputs, self.ref_model)
        # per (shape, gradient): the previous call's gradient tensor (held, so its memory cannot be handed
        # out again), its value and the reference's value then
        self._last_grads: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.bwd_calls, self.grad_err, self.torch_err = 0, 0.0, 0.0

    # ---- driving
    def run(self) -> Finding | None:
        try:
            torch.manual_seed(self.seed)
            self.cand = self.cand_cls(*self.init).to(self.device)
            shared = _share_weights(self.native_model, self.cand)
        except Exception as err:  # noqa: BLE001 - candidate code
            return self._error(err, _Ctx(None, "-", self.seed, "construct ModelNew"))
        if shared:
            self.notes.append(f"weights shared from Model by name: {', '.join(shared)}")
        cases, notes = plan_cases(self.spec, self.own_inputs, self.opts.max_cases)
        self.notes += notes
        for ci, case in enumerate(cases or [None]):
            finding = self._run_case(ci, case)
            if finding:
                return finding
        return None

    def _run_case(self, ci: int, case: ShapeCase | None) -> Finding | None:
        for di, dist in enumerate(self.opts.distributions):
            ctx = _Ctx(case, dist, self.seed + 1000 * ci + di, "fresh inputs")
            inputs = self._leaves(make_inputs(self.spec, self.layout, case, dist, ctx.seed, self.device))
            try:
                ref = reference_output(self.ref_model, inputs)
            except Exception as err:  # noqa: BLE001 - spec code rejecting a planned shape
                if case is None or case.origin == "spec":
                    raise SpecError(f"spec's Model fails on its own get_inputs(): {type(err).__name__}: {err}") from err
                self.notes.append(f"shape {case.label()} dropped: the spec's Model rejects it ({type(err).__name__})")
                return None
            if di == 0:
                if case is not None:
                    self.cases_run.append(case)
                self._measure_reference(inputs)
            finding, out = self._checked_call(inputs, ref, ctx)
            if finding or di > 0:
                if finding:
                    return finding
                continue
            finding = self._probes(case, dist, ctx, inputs)
            if finding:
                return finding
        return None

    def _probes(self, case: ShapeCase | None, dist: str, ctx: _Ctx, inputs: list[Any]) -> Finding | None:
        probe_seed = ctx.seed + 500
        fresh = make_inputs(self.spec, self.layout, case, dist, probe_seed, self.device)
        with torch.no_grad():  # q, k, v may be leaves that require grad
            for dst, src in zip(inputs, fresh):
                if isinstance(dst, torch.Tensor) and dst.is_floating_point():
                    dst.copy_(src)
        ref = reference_output(self.ref_model, inputs)
        finding, out = self._checked_call(inputs, ref, _Ctx(case, dist, probe_seed, "same storage, new values"))
        if finding or not self.opts.determinism:
            return finding
        clones = self._leaves([x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs])
        dctx = _Ctx(case, dist, probe_seed, "determinism rerun")
        finding, again = self._checked_call(clones, ref, dctx)
        if finding:
            return finding
        if not torch.equal(out, again):
            diff = float((out.float() - again.float()).abs().max())
            return self._finding(Verdict.nondeterministic, "two runs on identical inputs differ", dctx,
                                 op="nondeterministic", max_abs_err=diff)
        return None

    # ---- one call
    def _checked_call(self, inputs: list[Any], ref: torch.Tensor, ctx: _Ctx) -> tuple[Finding | None, Any]:
        self._progress(ctx)
        saved = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        ptrs = storage_ptrs(inputs)
        expected_dtype = self._expected_dtype()
        poison_allocator(ref.numel() * torch.empty((), dtype=expected_dtype).element_size(), self.device)
        guard = CallGuard(not self.opts.torch_baseline, str(self.spec.path), inputs, ref.numel())
        out, error = None, None
        with measure_peak(self.device) as peak:
            try:
                with guard, torch.set_grad_enabled(self.opts.backward):
                    out = self.cand(*inputs)
                    if self.device == "cuda":
                        torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - candidate code
                error = err
        self.calls += 1
        if self.calls > 1:  # the first call pays for JIT compilation and lazy imports
            self.cand_peak = max(self.cand_peak, peak.mib)
        if guard.violation:
            v = guard.violation
            return self._finding(v.verdict, v.message, ctx, op=v.op), out
        if error is not None:
            return self._error(error, ctx), out
        finding = self._check_output(out, inputs, saved, ptrs, ref, expected_dtype, ctx)
        if finding is None and self.opts.backward:
            finding = self._check_backward(out, inputs, replace(ctx, step=ctx.step + ", backward"))
        return finding, out

    def _check_output(self, out: Any, inputs: list[Any], saved: list[Any], ptrs: set[int], ref: torch.Tensor,
                      expected_dtype: torch.dtype, ctx: _Ctx) -> Finding | None:
        if not isinstance(out, torch.Tensor):
            return self._finding(Verdict.shape_mismatch, f"forward returned {type(out).__name__}, not a tensor", ctx)
        problem = identity_problem(out, ptrs)
        if problem:
            return self._finding(Verdict.hack_suspected, problem[1], ctx, op=problem[0])
        if any(isinstance(a, torch.Tensor) and not torch.equal(a, b) for a, b in zip(inputs, saved)):
            return self._finding(Verdict.hack_suspected, "forward modified its inputs in place", ctx, op="modifies_inputs")
        if tuple(out.shape) != tuple(ref.shape) or out.dtype != expected_dtype:
            return self._finding(Verdict.shape_mismatch, f"output {tuple(out.shape)} {out.dtype}, expected "
                                 f"{tuple(ref.shape)} {expected_dtype}", ctx)
        key = tuple(ref.shape)
        prev = self._last.get(key)
        self._last[key] = (out.detach().clone(), ref.clone())
        if prev is not None and torch.equal(prev[0], out) and not torch.allclose(prev[1], ref, equal_nan=True):
            return self._finding(Verdict.hack_suspected, "returned the previous call's output for different inputs "
                                 "(result cached by address or shape)", ctx, op="cached_result")
        cmp = compare(out, ref, expected_dtype)
        self.max_abs, self.max_rel = max(self.max_abs, cmp.max_abs_err), max(self.max_rel, cmp.max_rel_err)
        if not cmp.ok:
            what = f"{cmp.nonfinite} NaN/Inf where the reference is finite; " if cmp.nonfinite else ""
            return self._finding(Verdict.numeric_mismatch, f"{what}{cmp.bad_elements} elements out of tolerance, "
                                 f"first at {cmp.first_bad}", ctx, max_abs_err=cmp.max_abs_err, max_rel_err=cmp.max_rel_err)
        return None

    # ---- backward
    def _leaves(self, inputs: list[Any]) -> list[Any]:
        """With `backward`, the differentiated inputs become leaves that require grad (in place: fresh tensors)."""
        if self.opts.backward:
            for i in self.targets.positions:
                inputs[i].requires_grad_(True)
        return inputs

    def _check_backward(self, out: torch.Tensor, inputs: list[Any], ctx: _Ctx) -> Finding | None:
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
        """fp32 reference gradients and, per gradient, how far torch's own gradients in the spec's dtype are from them."""
        try:
            ref = model_grads(self.ref_model, inputs, self.targets, d_out)
            lowp = model_grads(self.ref_model, inputs, self.targets, d_out, emulate=self._expected_dtype(),
                               truncate=self._interpreted()) if self._expected_dtype() != torch.float32 else [None] * len(ref)
        except Exception as err:  # noqa: BLE001 - spec code
            raise SpecError(f"the spec's Model has no usable backward: {type(err).__name__}: {err}") from err
        errs = [torch_error(lo, r) for lo, r in zip(lowp, ref)]
        self.torch_err = max([self.torch_err] + [e / grad_scale(r) for e, r in zip(errs, ref) if r is not None])
        return ref, errs

    def _interpreted(self) -> bool:
        """Triton kernels run by the interpreter (CPU), whose fp32 -> bf16 conversion truncates."""
        return self.device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"

    def _candidate_params(self, ctx: _Ctx) -> tuple[list[torch.Tensor], Finding | None]:
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
                         ctx: _Ctx) -> tuple[list[torch.Tensor | None], Finding | None]:
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
        except Exception as err:  # noqa: BLE001 - candidate code
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
                    avoid: set[int], key: tuple[Any, ...], ctx: _Ctx) -> Finding | None:
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

    # ---- helpers
    def _expected_dtype(self) -> torch.dtype:
        if not hasattr(self, "_dtype"):
            with torch.no_grad():
                self._dtype = self.native_model(*self.own_inputs_on_device()).dtype
        return self._dtype

    def own_inputs_on_device(self) -> list[Any]:
        return [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in self.own_inputs]

    def _measure_reference(self, inputs: list[Any]) -> None:
        native = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        with measure_peak(self.device) as peak, torch.no_grad():
            self.native_model(*native)
        self.ref_peak, self.mem_method = max(self.ref_peak, peak.mib), peak.method

    def _progress(self, ctx: _Ctx) -> None:
        if self.progress is not None:
            label = ctx.case.label() if ctx.case else "spec inputs"
            self.progress.write_text(f"{label} | {ctx.dist} | seed {ctx.seed} | {ctx.step}")

    def _finding(self, verdict: Verdict, message: str, ctx: _Ctx, **kw: Any) -> Finding:
        where = f" [{ctx.case.label() if ctx.case else 'spec inputs'}, {ctx.dist}, seed {ctx.seed}, {ctx.step}]"
        return Finding(verdict, message + where, case=ctx.case, distribution=ctx.dist, seed=ctx.seed, **kw)

    def _error(self, err: BaseException, ctx: _Ctx, what: str = "", phase: str = "forward") -> Finding:
        compile_err = type(err).__name__ in {"CompilationError", "CompileTimeAssertionFailure"}
        verdict = Verdict.compile_error if compile_err else Verdict.runtime_error
        detail = "".join(traceback.format_exception(err, limit=-4))[-4000:]
        return self._finding(verdict, f"{what}{type(err).__name__}: {str(err)[:300]}", ctx, detail=detail, phase=phase)

    # ---- timing and result
    def time_it(self) -> TimingReport:
        if self.device != "cuda":
            return TimingReport(timed=False, reason="no CUDA device: not timed")
        inputs = make_inputs(self.spec, self.layout, None, "normal", self.seed, self.device)
        o = self.opts
        with torch.no_grad():
            cand = time_fn(lambda: self.cand(*inputs), o.warmup, o.trials, o.flush_bytes)
            with tf32(True):  # baselines run as users run them: TF32 on for fp32
                base = time_fn(lambda: self.native_model(*inputs), o.warmup, o.trials, o.flush_bytes)
        limit = self._limit_ms(inputs)
        return TimingReport(timed=True, candidate_ms=cand.median_ms, candidate_iqr_ms=cand.iqr_ms,
                            baseline_ms=base.median_ms, baseline_iqr_ms=base.iqr_ms, limit_ms=limit,
                            speedup=base.median_ms / cand.median_ms, perf_term=perf_term(cand.median_ms, base.median_ms, limit))

    def _limit_ms(self, inputs: list[Any]) -> float | None:
        if self.layout.qkv is None:
            return None
        q, k, v = (inputs[i] for i in self.layout.qkv)
        B, Hq, Sq, D = q.shape
        frac = 0.5 if self.spec.causal else 1.0
        flops = attention_flops(B, Hq, Sq, k.shape[2], D, frac, Dv=v.shape[3])
        nbytes = attention_bytes(B, Hq, k.shape[1], Sq, k.shape[2], D, q.element_size(), Dv=v.shape[3])
        return roofline_ms(flops, nbytes, self.opts.peak_tflops, self.opts.peak_gbps)

    def result(self, verdict: Verdict, message: str, finding: Finding | None, timing: TimingReport | None,
               duration: float, base: dict[str, Any]) -> VerifyResult:
        perf = timing.perf_term if timing and timing.timed else None
        return VerifyResult(
            verdict=verdict, message=message, finding=finding, cases=tuple(self.cases_run),
            distributions=tuple(self.opts.distributions), calls=self.calls, max_abs_err=self.max_abs,
            max_rel_err=self.max_rel, memory=MemoryReport(self.cand_peak, self.ref_peak, self.mem_method),
            timing=timing, score=composite_score(verdict is not Verdict.compile_error, verdict is Verdict.passed, perf),
            notes=tuple(self.notes), duration_s=duration, backward=self.backward_report(), **base)


def _share_weights(model: torch.nn.Module, cand: torch.nn.Module) -> list[str]:
    """Copy Model's parameters and buffers into same-named, same-shaped ones of ModelNew.

    Weights are inputs of the computation (KernelBench gets the same effect by seeding both
    constructors); copying by name lets a candidate declare the weights without re-creating
    the spec's initialisation. Nothing else of Model reaches the candidate."""
    theirs = model.state_dict()
    mine = cand.state_dict()
    same = {k: v for k, v in theirs.items() if k in mine and mine[k].shape == v.shape}
    if same:
        cand.load_state_dict(same, strict=False)
    return sorted(same)
