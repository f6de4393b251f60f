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
forward passes is followed by one guarded backward (verify.backward.BackwardChecks).
"""

from __future__ import annotations

import copy
import logging
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from verify.backward import BackwardChecks
from verify.checks import compare, identity_problem, storage_ptrs
from verify.context import Ctx
from verify.grads import grad_targets
from verify.guard import CallGuard
from verify.inputs import make_inputs
from verify.serving_cases import serving_variants
from verify.load import Spec, SpecError
from verify.memory import measure_peak, poison_allocator
from verify.options import VerifyOptions
from verify.reference import reference_output, tf32
from verify.result import Finding, MemoryReport, ShapeCase, TimingReport, Verdict, VerifyResult
from verify.shapes import Layout, find_layout, plan_cases
from verify.timing import attention_bytes, attention_flops, composite_score, perf_term, roofline_ms, time_fn

__all__ = ["Session"]

log = logging.getLogger(__name__)


class Session(BackwardChecks):
    def __init__(self, spec: Spec, cand_cls: type, opts: VerifyOptions, device: str, seed: int, progress: Path | None) -> None:
        self.spec, self.opts, self.device, self.seed, self.progress = spec, opts, device, seed, progress
        self.calls, self.max_abs, self.max_rel = 0, 0.0, 0.0
        self.cand_peak, self.ref_peak, self.mem_method = 0.0, 0.0, ""
        self.cases_run: list[ShapeCase] = []
        self.serving_checked: list[str] = []  # the serving-layout variants that passed (verify.serving_cases)
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
        except Exception as err:
            return self._error(err, Ctx(None, "-", self.seed, "construct ModelNew"))
        if shared:
            self.notes.append(f"weights shared from Model by name: {', '.join(shared)}")
        cases, notes = plan_cases(self.spec, self.own_inputs, self.opts.max_cases)
        self.notes += notes
        for ci, case in enumerate(cases or [None]):
            finding = self._run_case(ci, case)
            if finding:
                return finding
        finding = self._serving_layouts() if self.opts.serving else None
        return finding or self._redrawn_parameters(cases[0] if cases else None)

    def _serving_layouts(self) -> Finding | None:
        """One call on each serving-layout variant of the spec's own inputs (verify.serving_cases): pages moved and
        shared, ragged and empty sequences."""
        assert self.opts.serving is not None
        dist = self.opts.distributions[0]
        variants = serving_variants(self.spec.model_cls, self.own_inputs, self.opts.serving, self.seed + 300)
        for i, (what, base) in enumerate(variants):
            ctx = Ctx(None, dist, self.seed + 300 + i, f"serving layout: {what}")
            inputs = self._leaves(make_inputs(self.spec, self.layout, None, dist, ctx.seed, self.device, base=base))
            finding, _ = self._checked_call(inputs, reference_output(self.ref_model, inputs), ctx)
            if finding:
                return finding
            self.notes.append(f"serving layout checked: {what}")
            self.serving_checked.append(what)
        return None

    def _redrawn_parameters(self, case: ShapeCase | None) -> Finding | None:
        """One more call with every learned tensor of Model (an nn.Parameter of at least one dim) redrawn as N(0, 3),
        shared into ModelNew by name as before. Training moves parameters anywhere, and at their initial values some
        barely matter (attention sinks at +-1 against hundreds of keys): a kernel that ignores or bakes one passes the
        calls above but not this one. Scalars (a learnable temperature) keep their values: 0 or a sign flip is no
        state a model trains through."""
        redrawn = [(n, p) for n, p in self.native_model.named_parameters() if p.dim() >= 1]
        if not redrawn:
            return None
        gen = torch.Generator().manual_seed(self.seed + 77)
        ref_params = dict(self.ref_model.named_parameters())
        with torch.no_grad():
            for name, p in redrawn:
                p.copy_((3.0 * torch.randn(p.shape, generator=gen)).to(p.dtype))
                ref_params[name].copy_(p.float())
        try:
            _share_weights(self.native_model, self.cand)
        except Exception as err:
            return self._error(err, Ctx(case, "-", self.seed + 77, "share redrawn parameters"))
        self.notes.append(f"one call with learned parameters redrawn as N(0, 3): {', '.join(n for n, _ in redrawn)}")
        dist = self.opts.distributions[0]
        ctx = Ctx(case, dist, self.seed + 77, "learned parameters redrawn")
        inputs = self._leaves(make_inputs(self.spec, self.layout, case, dist, ctx.seed, self.device))
        finding, _ = self._checked_call(inputs, reference_output(self.ref_model, inputs), ctx)
        return finding

    def _run_case(self, ci: int, case: ShapeCase | None) -> Finding | None:
        for di, dist in enumerate(self.opts.distributions):
            ctx = Ctx(case, dist, self.seed + 1000 * ci + di, "fresh inputs")
            inputs = self._leaves(make_inputs(self.spec, self.layout, case, dist, ctx.seed, self.device))
            try:
                ref = reference_output(self.ref_model, inputs)
            except Exception as err:
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

    def _probes(self, case: ShapeCase | None, dist: str, ctx: Ctx, inputs: list[Any]) -> Finding | None:
        probe_seed = ctx.seed + 500
        fresh = make_inputs(self.spec, self.layout, case, dist, probe_seed, self.device)
        with torch.no_grad():  # q, k, v may be leaves that require grad
            for dst, src in zip(inputs, fresh):
                if isinstance(dst, torch.Tensor) and dst.is_floating_point():
                    dst.copy_(src)
        ref = reference_output(self.ref_model, inputs)
        finding, out = self._checked_call(inputs, ref, Ctx(case, dist, probe_seed, "same storage, new values"))
        if finding or not self.opts.determinism:
            return finding
        clones = self._leaves([x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs])
        dctx = Ctx(case, dist, probe_seed, "determinism rerun")
        finding, again = self._checked_call(clones, ref, dctx)
        if finding:
            return finding
        if not torch.equal(out, again):
            diff = float((out.float() - again.float()).abs().max())
            return self._finding(Verdict.nondeterministic, "two runs on identical inputs differ", dctx,
                                 op="nondeterministic", max_abs_err=diff)
        return None

    # ---- one call
    def _checked_call(self, inputs: list[Any], ref: torch.Tensor, ctx: Ctx) -> tuple[Finding | None, Any]:
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
            except Exception as err:
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
            assert isinstance(out, torch.Tensor)  # _check_output finds anything else
            finding = self._check_backward(out, inputs, replace(ctx, step=ctx.step + ", backward"))
        return finding, out

    def _check_output(self, out: Any, inputs: list[Any], saved: list[Any], ptrs: set[int], ref: torch.Tensor,
                      expected_dtype: torch.dtype, ctx: Ctx) -> Finding | None:
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

    def _progress(self, ctx: Ctx) -> None:
        if self.progress is not None:
            label = ctx.case.label() if ctx.case else "spec inputs"
            self.progress.write_text(f"{label} | {ctx.dist} | seed {ctx.seed} | {ctx.step}")

    def _finding(self, verdict: Verdict, message: str, ctx: Ctx, **kw: Any) -> Finding:
        where = f" [{ctx.case.label() if ctx.case else 'spec inputs'}, {ctx.dist}, seed {ctx.seed}, {ctx.step}]"
        return Finding(verdict, message + where, case=ctx.case, distribution=ctx.dist, seed=ctx.seed, **kw)

    def _error(self, err: BaseException, ctx: Ctx, what: str = "", phase: str = "forward") -> Finding:
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
        # no q/k/v layout, no roofline: the hardware-anchored term is unknown (was a TypeError in min(None, ...))
        perf = perf_term(cand.median_ms, base.median_ms, limit) if limit is not None else None
        return TimingReport(timed=True, candidate_ms=cand.median_ms, candidate_iqr_ms=cand.iqr_ms,
                            baseline_ms=base.median_ms, baseline_iqr_ms=base.iqr_ms, limit_ms=limit,
                            speedup=base.median_ms / cand.median_ms, perf_term=perf)

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
