"""Forward+backward of generated candidates on a GPU, beside FlexAttention and SDPA (issue #15's bench).

    python -m bench.gpu.tune_bwd PLAN.json RESULTS.json [--trials 20] [--deadline-s 300] [--workers 12]
    python -m bench.gpu.tune_bwd --suite bench/heldout/backward_suite.txt --from out/heldout RESULTS.json
    python -m bench.gpu.tune --backward ...                      (the same, through the forward timer's CLI)
    TRITON_INTERPRET=1 python -m bench.gpu.tune_bwd --cpu-dry-run ...   (no GPU: small shapes, not measurements)

The plan is the forward timer's (`kb bench --plan`; a forward plan's designs are ignored: a backward candidate
picks its own), `kb tune --backward --plan`'s (its entries carry the backward kernel and the backward designs to
time), or is built here from a suite file and the `--out` directory of `kb generate` (no KB needed). Per entry, at the spec's `BENCH` shape, on the same bf16 inputs, one upstream gradient dO:

- the reference: the spec's `flex_mods` evaluated densely in fp32, forward and autograd backward, in row
  chunks (softmax is row-wise, so the gradients are sums over chunks); it gives dq, dk, dv and the gradient
  of every learnable parameter of the spec's Model (a T5 bias table);
- `emitted`: `out = ModelNew(*init)(q, k, v, *aux); out.backward(dO)` as a training step runs it, q/k/v
  leaves requiring grad, the spec's parameters as trainable parameters of ModelNew. First one checked call:
  an output without `grad_fn`, or a backward that raises, is `no_backward` (with the message); a forward or
  a gradient off the reference (relative Frobenius error per gradient > GRAD_TOL) is `mismatch`, not timed;
- `flex`: `torch.compile(flex_attention)` forward+backward (block mask built once, outside the timing), its
  `score_mod` closing over the Model's parameters, so it also computes their gradients; if that fails for a
  spec with parameters, `flex (table grad off)` times it with the parameters frozen (labelled);
- `sdpa`: `F.scaled_dot_product_attention` forward+backward where the spec's `SDPA` says it computes the same;
- with a `kb tune --backward` plan, `design <d>` per backward design instead of the baselines: the same training
  step with the module's backward forced to `d` (its forward as emitted), gradients checked first; `does_not_fit`
  where the GPU cannot run it.

Each timed call is one training step: grads set to None, forward, backward (`verify.timing.time_fn(drain=False)`,
as the forward timer). The no-grad forward is timed too (`fwd_ms`), so `ms - fwd_ms` estimates the backward.
FLOPs (FLOP_CONVENTION): forward 2·Hq·pairs·(D + Dv), backward 2·Hq·pairs·(3·D + 2·Dv) (five matmuls:
S again, dV, dP, dQ, dK); with Dv = D: 4·D and 10·D per attended (q, kv) pair and query head.
Results (schema `kernel-kb/tune-backward/v1`) are written after every entry. Needs torch and triton, not the KB.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench.gpu import tune_common as common
from generate.outputs import output_stem
from generate.tune_schema import SCHEMA_BACKWARD as SCHEMA
from generate.stages import ReportStatus
from kb.ir.design import arch_of_capability, parse_design

__all__ = ["SCHEMA", "GRAD_TOL", "FLOP_CONVENTION", "SuiteRow", "Impl", "Reference", "fwd_bwd_flops", "rel_fro",
           "read_suite", "suite_plan", "reference_grads", "bwd_record", "run_plan_backward", "summarize",
           "summary_line", "main"]

log = logging.getLogger(__name__)

GRAD_TOL = 2e-2  # relative Frobenius error allowed per gradient (bf16 inputs and outputs, fp32 reference)
FLOP_CONVENTION = ("forward 2*Hq*pairs*(D+Dv), backward 2*Hq*pairs*(3*D+2*Dv) (S recomputed, dV, dP, dQ, dK); "
                   "with Dv=D: 4*D and 10*D per attended (q, kv) pair (summed over the batch) and query head; "
                   "tflops = (forward + backward) / fwd+bwd time")
_DOUT_SEED = 4321
_REF_CHUNK_ELEMS = 1 << 26  # fp32 scores per reference chunk (256 MB); a few such tensors live until its backward


# ---- pure parts: FLOPs, errors, the suite -----------------------------------------------------------

def fwd_bwd_flops(hq: int, d: int, dv: int, pairs: int) -> tuple[float, float]:
    """(forward, backward) FLOPs for `pairs` attended (q, kv) pairs per query head, summed over the batch."""
    return 2.0 * hq * pairs * (d + dv), 2.0 * hq * pairs * (3 * d + 2 * dv)


def rel_fro(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref||_F / ||ref||_F in fp32 (the absolute norm when ref is 0; inf for a shape mismatch or non-finite)."""
    if tuple(got.shape) != tuple(ref.shape):
        return math.inf
    diff = float((got.detach().float() - ref.float()).norm())
    den = float(ref.float().norm())
    err = diff / den if den > 0 else diff
    return err if math.isfinite(err) else math.inf


@dataclass(frozen=True)
class SuiteRow:
    tier: str  # core | extra
    klass: str
    spec: Path


def read_suite(path: Path) -> list[SuiteRow]:
    """Rows `tier class spec-stem` of a suite file (comments with #); spec files sit beside it."""
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            tier, klass, stem = line.split()
            rows.append(SuiteRow(tier, klass, Path(path).parent / f"{stem}.py"))
    return rows


def suite_plan(suite: Path, from_dir: Path, tier: str | None = None) -> dict:
    """A plan (the forward timer's schema) for a suite file (only the rows of `tier` if given): each spec's candidate
    is `gen_<stem>.py` in `from_dir`, at the spec's BENCH shape, no designs."""
    entries: list[dict[str, Any]] = [
        {"name": r.spec.stem, "spec": str(r.spec), "candidate": str(Path(from_dir) / f"{output_stem(r.spec)}.py"),
         "shapes": None, "designs": [], "tier": r.tier, "class": r.klass} for r in read_suite(suite)
        if tier is None or r.tier == tier]
    return {"schema": common.PLAN_SCHEMA, "suite": str(suite), "entries": entries}


# ---- implementations as a training step calls them ----------------------------------------------------

@dataclass
class Impl:
    """One implementation: `call()` is its forward with autograd on; `leaves` are the tensors whose gradients it
    owes, by name (q, k, v and the learnable parameters, by their state_dict key)."""
    call: Callable[[], Any]
    leaves: dict[str, torch.Tensor]

    def zero_grads(self) -> None:
        for t in self.leaves.values():
            t.grad = None

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {n: t.grad for n, t in self.leaves.items()}


@dataclass(frozen=True)
class Reference:
    out: torch.Tensor  # fp32 forward output
    grads: dict[str, torch.Tensor]  # fp32 gradients by leaf name
    dout: torch.Tensor  # the upstream gradient every implementation gets (the inputs' dtype)
    how: str


def _learnable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _leaf_inputs(inputs: list) -> list:
    """q, k, v as fresh leaves that require grad; aux inputs (ids, lengths) as they are."""
    return [t.detach().requires_grad_() for t in inputs[:3]] + list(inputs[3:])


def _out(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, tuple) else x


# ---- the reference: dense fp32 autograd in row chunks ---------------------------------------------------

@contextlib.contextmanager
def _exact_matmuls() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _dense_chunk(spec: ModuleType, mods: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int,
                 rows: slice) -> torch.Tensor:
    """Output rows `rows` of batch `b` in fp32, autograd on (k/v heads repeated for GQA inside the graph)."""
    score_mod, mask_mod = mods
    Hq, D, N = q.shape[1], q.shape[3], k.shape[2]
    rep = Hq // k.shape[1]
    dev = q.device
    scale = getattr(spec, "SCALE", None) or 1.0 / math.sqrt(D)
    bt = torch.tensor(b, device=dev)
    h_idx = torch.arange(Hq, device=dev).view(-1, 1, 1)
    q_idx = torch.arange(rows.start, rows.stop, device=dev).view(1, -1, 1)
    kv_idx = torch.arange(N, device=dev).view(1, 1, -1)
    s = (q[b, :, rows] @ k[b].repeat_interleave(rep, 0).transpose(-1, -2)) * scale
    if score_mod is not None:
        s = score_mod(s, bt, h_idx, q_idx, kv_idx).float()
    if mask_mod is None:
        return torch.softmax(s, -1) @ v[b].repeat_interleave(rep, 0)
    keep = torch.as_tensor(mask_mod(bt, h_idx, q_idx, kv_idx)).bool()
    seen = keep.any(-1, keepdim=True)  # rows with no visible key give 0 (as FlexAttention), finite gradients
    s = torch.where(seen, s.masked_fill(~keep, float("-inf")), torch.zeros((), device=dev))
    return (torch.softmax(s, -1) * seen) @ v[b].repeat_interleave(rep, 0)


def _dense_fwd_bwd(spec: ModuleType, mods: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   dout: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    B, Hq, M = q.shape[:3]
    out = torch.empty(B, Hq, M, v.shape[-1], dtype=torch.float32, device=q.device)
    step = max(1, chunk_elems // (Hq * k.shape[2]))
    for b in range(B):
        for r0 in range(0, M, step):
            rows = slice(r0, min(M, r0 + step))
            o = _dense_chunk(spec, mods, q, k, v, b, rows)
            o.backward(dout[b, :, rows].float())  # each chunk's graph is freed; gradients accumulate in the leaves
            out[b, :, rows] = o.detach()
    return out


def reference_grads(spec: ModuleType, inputs: list, model: torch.nn.Module, dout: torch.Tensor,
                    chunk_elems: int = _REF_CHUNK_ELEMS) -> Reference:
    """fp32 forward and autograd backward of the spec on `inputs` (dO = `dout`): from `flex_mods` densely in row
    chunks where the spec gives them, else the spec Model's own autograd. Gradients of q, k, v and of every
    learnable parameter of a copy of `model` (so `model` itself is untouched)."""
    ref_model = copy.deepcopy(model).float()
    params = _learnable(ref_model)
    q, k, v = (t.detach().float().requires_grad_() for t in inputs[:3])
    aux = list(inputs[3:])
    with torch.enable_grad(), _exact_matmuls():
        mods = common.spec_mods(spec, [q, k, v, *aux], ref_model)
        if mods is None:
            out = _out(ref_model(q, k, v, *aux)).float()
            out.backward(dout.float())
            out, how = out.detach(), "spec Model autograd (fp32)"
        else:
            out = _dense_fwd_bwd(spec, mods, q, k, v, dout, chunk_elems)
            how = "dense fp32 autograd from flex_mods (row chunks)"
    leaves = {"q": q, "k": k, "v": v, **params}
    grads = {n: (t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in leaves.items()}
    return Reference(out, grads, dout, how)


# ---- one record: check the gradients, then time -------------------------------------------------------

def _first_call(impl: Impl, dout: torch.Tensor) -> tuple[dict, torch.Tensor | None]:
    """Run forward+backward once: ({} and the output) or ({status, error}, None)."""
    impl.zero_grads()
    try:
        out = _out(impl.call())
    except Exception as err:
        return {"status": "error", "error": f"forward: {type(err).__name__}: {str(err)[:300]}"}, None
    if not isinstance(out, torch.Tensor) or out.grad_fn is None:
        return {"status": "no_backward", "error": "the output has no grad_fn: a forward-only candidate"}, None
    if out.shape != dout.shape:
        return {"status": "mismatch", "error": f"output shape {tuple(out.shape)} != {tuple(dout.shape)}"}, None
    try:
        out.backward(dout.to(out.dtype))
    except Exception as err:
        return {"status": "no_backward", "error": f"{type(err).__name__}: {str(err)[:300]}"}, None
    common.sync()
    return {}, out.detach()


def _grad_check(impl: Impl, ref: Reference) -> tuple[dict[str, float], list[str]]:
    """(relative Frobenius error per gradient the reference has, names the implementation gave no gradient for)."""
    got = impl.grads()
    errs, missing = {}, []
    for name, want in ref.grads.items():
        g = got.get(name)
        if g is None:
            missing.append(name)
            errs[name] = math.inf
        else:
            errs[name] = rel_fro(g, want)
    return errs, missing


def _timed(impl: Impl, dout: torch.Tensor, trials: int) -> dict:
    def step() -> None:
        impl.zero_grads()
        _out(impl.call()).backward(dout)

    def forward_only() -> Any:
        with torch.no_grad():
            return impl.call()

    ms, iqr, n = common.time_call(step, trials)
    fwd_ms, _, _ = common.time_call(forward_only, trials)
    impl.zero_grads()
    return {"ms": ms, "iqr_ms": iqr, "trials": n, "fwd_ms": fwd_ms, "bwd_ms_est": ms - fwd_ms}


def bwd_record(label: str, impl: Impl | None, ref: Reference, flops: float, trials: int, check: bool = True) -> dict:
    """One implementation's record: `n/a`, `error`, `no_backward` (with the message), `mismatch` (forward or a
    gradient off the reference; never timed when `check`), or `ok` with fwd+bwd ms and TFLOP/s. Baselines
    (`check=False`) are timed whatever their error, which is recorded."""
    rec: dict[str, Any] = {"impl": label}
    if impl is None:
        return {**rec, "status": "n/a"}
    try:
        first, out = _first_call(impl, ref.dout)
        if out is None:
            return {**rec, **first}
        rec["out_err"] = float((out.float() - ref.out).abs().max()) if out.shape == ref.out.shape else math.inf
        rec["grad_err"], missing = _grad_check(impl, ref)
        if missing:
            rec["missing_grads"] = missing
        bad = [n for n, e in rec["grad_err"].items() if not e <= GRAD_TOL]
        out_ok = common.output_ok(out.float(), ref.out)
        if check and (bad or not out_ok):
            return {**rec, "status": "mismatch", "error": _mismatch_text(rec["out_err"], out_ok, bad, missing)}
        timed = _timed(impl, ref.dout.to(out.dtype), trials)
        return {**rec, "status": "ok", **timed, "tflops": flops / timed["ms"] / 1e9}
    except Exception as err:
        return {**rec, "status": "error", "error": f"{type(err).__name__}: {str(err)[:300]}"}
    finally:
        impl.zero_grads()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _mismatch_text(out_err: float, out_ok: bool, bad: list[str], missing: list[str]) -> str:
    parts = [] if out_ok else [f"forward outside the verifier's bf16 tolerance (max abs err {out_err:.3g})"]
    parts += [f"gradient of {n} rel. Frobenius err > {GRAD_TOL}" for n in bad if n not in missing]
    parts += [f"no gradient for {n}" for n in missing]
    return "; ".join(parts)


# ---- one entry ------------------------------------------------------------------------------------

@dataclass
class _Emitted:
    impl: Impl  # ModelNew as a training step calls it
    model: torch.nn.Module  # the spec's Model at this shape (its parameters trainable: FlexAttention's closure)
    names: list[str]  # the spec Model's learnable parameters, by state_dict key
    module: ModuleType  # the candidate file


def _emitted_impl(entry: dict, spec: ModuleType, shape: dict, device: str, tag: str, inputs: list) -> _Emitted:
    """ModelNew with the spec Model's values; the spec's learnable parameters trainable in it, by the same name."""
    cand, model, new = common.load_candidate(entry, spec, shape, device, tag)
    names = list(_learnable(model))
    leaves = dict(zip("qkv", inputs[:3]))
    for n in names:
        with contextlib.suppress(AttributeError):  # a candidate without the parameter owes it: missing, mismatch
            leaves[n] = new.get_parameter(n).requires_grad_(True)
    return _Emitted(Impl(lambda: new(*inputs), leaves), model, names, cand)


def _flex_impls(spec: ModuleType, inputs: list, model: torch.nn.Module, names: list[str]) -> tuple[Impl | None, Callable]:
    """FlexAttention with the Model's learnable parameters trainable, and a maker of the frozen-parameter variant."""
    call = common.flex_call(spec, inputs, model)
    leaves = {**dict(zip("qkv", inputs[:3])), **{n: model.get_parameter(n) for n in names}}

    def frozen() -> Impl | None:
        still = copy.deepcopy(model).requires_grad_(False)
        c = common.flex_call(spec, inputs, still)
        return None if c is None else Impl(c, dict(zip("qkv", inputs[:3])))

    return (None if call is None else Impl(call, leaves)), frozen


def _shape_dims(inputs: list) -> dict:
    q, k, v = inputs[:3]
    dims = {"B": q.shape[0], "Hq": q.shape[1], "Hkv": k.shape[1], "M": q.shape[2], "N": k.shape[2], "D": q.shape[3]}
    if v.shape[3] != q.shape[3]:
        dims["Dv"] = v.shape[3]
    return dims


def _dout(shape: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(_DOUT_SEED)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


@dataclass
class _Step:
    """One training step's setup at one shape: the emitted candidate, its inputs, one dO and the reference gradients."""
    inputs: list
    em: _Emitted
    dims: dict
    pairs: int  # attended (query, key) pairs
    flops_fwd: float
    flops_bwd: float
    dout: torch.Tensor
    ref: Reference


def _prepare_step(entry: dict, spec: ModuleType, shape: dict, tag: str, device: str) -> _Step:
    inputs = _leaf_inputs(common.make_inputs(spec, shape, device))
    em = _emitted_impl(entry, spec, shape, device, tag, inputs)
    dims = _shape_dims(inputs)
    pairs = common.attended_pairs(spec, [t.detach() for t in inputs], em.model)
    f_fwd, f_bwd = fwd_bwd_flops(dims["Hq"], dims["D"], dims.get("Dv", dims["D"]), pairs)
    dout = _dout((dims["B"], dims["Hq"], dims["M"], dims.get("Dv", dims["D"])), inputs[0].dtype, device)
    return _Step(inputs, em, dims, pairs, f_fwd, f_bwd, dout, reference_grads(spec, inputs, em.model, dout))


def _run_shape(entry: dict, spec: ModuleType, shape: dict, tag: str, trials: int, device: str, deadline: float) -> dict:
    if device == "cpu":
        shape = {}  # the CPU dry run works at the spec's own small shape
    st = _prepare_step(entry, spec, shape, tag, device)
    inputs, em, dims, ref = st.inputs, st.em, st.dims, st.ref
    model, names = em.model, em.names
    flops = st.flops_fwd + st.flops_bwd
    res: dict[str, Any] = {"shape": {**dims, "attended_pairs": st.pairs, "flops_fwd": st.flops_fwd,
                                     "flops_bwd": st.flops_bwd, "flops": flops},
                           "dtype": str(inputs[0].dtype).split(".")[-1], "learnable": names, "reference": ref.how}
    records = [bwd_record("emitted", em.impl, ref, flops, trials)]
    res["emitted_design"] = common.picked_design(em.module)
    if getattr(em.module, "_BWD_PICKED", None):
        res["emitted_bwd_design"] = common.picked_design(em.module, "_BWD_PICKED")
    records += _cuda_backward_records(em, ref, flops, trials, device)
    if entry.get("backward"):  # a design sweep: what ranks designs is their times against each other
        records += _design_records(em, entry["designs"], ref, flops, trials, deadline) if records[0]["status"] == "ok" else []
    else:
        if device == "cuda":
            records.append(_first_listed_record(em, ref, flops, trials))
        records += _baseline_records(spec, inputs, model, names, ref, flops, trials, device, res)
    res["records"] = records
    _ratios(res)
    return res


def _first_listed_record(em: _Emitted, ref: Reference, flops: float, trials: int) -> dict:
    """`emitted-first-listed`: the same step with the module's first listed designs (forward and backward) that fit,
    not the fastest it timed at its first call: what modules ran before they timed their designs (an ablation)."""
    with common.first_listed(em.module):
        rec = bwd_record("emitted-first-listed", em.impl, ref, flops, trials)
        ran = [d for d in (common.picked_design(em.module, n) for n in ("_PICKED", "_BWD_PICKED")) if d]
    return {**rec, "design": " / ".join(ran) or None}


def _cuda_backward_records(em: _Emitted, ref: Reference, flops: float, trials: int, device: str,
                           check: bool = True) -> list[dict]:
    """`emitted-cuda-bwd`: the same training step with the module's `.cu` Hopper backward listed for this GPU and every
    head-dim bucket (an ablation: the module as generated lists it only where measured faster); none where the `.cu`
    holds no backward, `declined` where its dispatch ran backward()'s Triton kernels instead."""
    module = em.module
    if device != "cuda" or not hasattr(module, "_cuda_backward") or "kb_launch_bwd" not in _cu_text(module):
        return []
    with cuda_backward_forced(module) as ran:
        rec = bwd_record("emitted-cuda-bwd", em.impl, ref, flops, trials, check)
    if rec["status"] == "ok" and not (ran and all(ran)):
        rec = {"impl": rec["impl"], "status": "declined", "error": "the `.cu` backward did not run (declined these inputs, or another copy of the operator ran)"}
    return [{**rec, "lowering": "sm90_wgmma"}]


@contextlib.contextmanager
def cuda_backward_forced(module: ModuleType) -> Iterator[list[bool]]:
    """Inside, the module's `.cu` Hopper backward is listed for this GPU and every head-dim bucket (an ablation); the
    list yielded gets, per backward call, whether the `.cu` ran (False: its dispatch declined and Triton ran)."""
    saved, real = getattr(module, "CUDA_BACKWARD"), getattr(module, "_cuda_backward")
    ran: list[bool] = []

    def watched(*args):
        grads = real(*args)
        ran.append(grads is not None)
        return grads

    setattr(module, "CUDA_BACKWARD", {_arch(): {b: "forced (ablation)" for b in (16, 32, 64, 128, 256)}})
    setattr(module, "_cuda_backward", watched)
    try:
        yield ran
    finally:
        setattr(module, "CUDA_BACKWARD", saved)
        setattr(module, "_cuda_backward", real)


def _cu_text(module: ModuleType) -> str:
    path = Path(module.__file__ or ".").with_name(getattr(module, "CUDA_SOURCE", "") or "none")
    return path.read_text() if path.is_file() else ""


@contextlib.contextmanager
def _backward_design(module: ModuleType, design: tuple) -> Iterator[None]:
    """Inside, the candidate's backward runs `design` and nothing else: the only design its table lists for every arch
    and head dim, and its program design (the interpreter's, and the GPU's fallback pool); choices are made afresh
    (the module's per-shape choices are cleared on the way in and out)."""
    saved = module.BWD_DESIGNS, module.BWD_PROGRAM_DESIGN
    setattr(module, "BWD_DESIGNS", {arch: {b: (design,) for b in (16, 32, 64, 128, 256)} for arch in {*saved[0], _arch()}})
    setattr(module, "BWD_PROGRAM_DESIGN", design)
    module._BWD_PICKED.clear()
    try:
        yield
    finally:
        setattr(module, "BWD_DESIGNS", saved[0])
        setattr(module, "BWD_PROGRAM_DESIGN", saved[1])
        module._BWD_PICKED.clear()


def _arch() -> str:
    return arch_of_capability(torch.cuda.get_device_capability()) if torch.cuda.is_available() else "cpu"


def _design_records(em: _Emitted, designs: list[str], ref: Reference, flops: float, trials: int,
                    deadline: float) -> list[dict]:
    """The training step at each backward design of a `kb tune --backward` plan (the forward as emitted), gradients
    checked first like the emitted record's; a design the GPU cannot run is `does_not_fit`, never another's time."""
    recs = []
    for text in designs:
        label = f"design {text}"
        if time.monotonic() > deadline:
            recs.append({"impl": label, "design": text, "status": "skipped", "error": "deadline"})
            continue
        want = parse_design(text).as_tuple()
        with _backward_design(em.module, want):
            rec = bwd_record(label, em.impl, ref, flops, trials)
            ran = {tuple(d) for d in em.module._BWD_PICKED.values()}
        if rec["status"] == "ok" and ran != {want}:
            rec = {"impl": label, "status": "does_not_fit",
                   "error": f"this GPU cannot run it (the module fell back to {sorted(ran)})"}
        recs.append({**rec, "design": text})
    return recs


def _baseline_records(spec: ModuleType, inputs: list, model: torch.nn.Module, names: list[str], ref: Reference,
                      flops: float, trials: int, device: str, res: dict) -> list[dict]:
    recs = []
    if device != "cuda":
        recs.append({"impl": "flex", "status": "n/a", "error": "FlexAttention has no CPU backward"})
    else:
        try:
            flex, frozen = _flex_impls(spec, inputs, model, names)
            recs.append(bwd_record("flex", flex, ref, flops, trials, check=False))
            if names and recs[-1]["status"] == "error":
                recs.append(bwd_record("flex (table grad off)", frozen(), ref, flops, trials, check=False))
        except Exception as err:
            res["flex_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            recs.append({"impl": "flex", "status": "error", "error": res["flex_error"]})
    sd = common.sdpa_call(spec, inputs)
    recs.append(bwd_record("sdpa", None if sd is None else Impl(sd, dict(zip("qkv", inputs[:3]))), ref, flops, trials,
                           check=False))
    return recs


def _ratios(res: dict) -> None:
    """x flex / x sdpa: the baseline's fwd+bwd time over the emitted one's (> 1: emitted is faster)."""
    ms = {r["impl"]: r["ms"] for r in res["records"] if r.get("status") == "ok"}
    em = ms.get("emitted")
    for base, key in (("flex", "vs_flex"), ("flex (table grad off)", "vs_flex_table_off"), ("sdpa", "vs_sdpa")):
        if em and ms.get(base):
            res[key] = ms[base] / em


_GENERATED = (ReportStatus.VERIFIED, ReportStatus.UNVERIFIED)  # report statuses that leave a candidate (as `kb tune` reads them)


def _generate_report(candidate: str) -> dict | None:
    """The report `kb generate` wrote beside the candidate (`gen_x.report.json`), when there is one."""
    path = Path(candidate).with_suffix(".report.json")
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _suite_row(spec_path: str) -> SuiteRow | None:
    """The row of the spec in the backward_suite.txt beside it, if any (plans from `kb bench --plan` lack tiers)."""
    suite = Path(spec_path).parent / "backward_suite.txt"
    rows = read_suite(suite) if suite.is_file() else []
    return next((r for r in rows if r.spec.resolve() == Path(spec_path).resolve()), None)


def _run_entry(entry: dict, idx: int, trials: int, deadline: float, device: str) -> dict:
    row = _suite_row(entry["spec"]) if entry.get("tier") is None else None
    out: dict[str, Any] = {"name": entry["name"], "spec": entry["spec"], "candidate": entry["candidate"],
                           "tier": entry.get("tier") or (row.tier if row else None),
                           "class": entry.get("class") or (row.klass if row else None), "shapes": [],
                           **({"kernel": entry["kernel"], "backward": True} if entry.get("backward") else {})}
    report = _generate_report(entry["candidate"])
    if report is not None:
        out["generate_status"] = report.get("status")
        if report.get("status") not in _GENERATED:
            return {**out, "error": f"kb generate: {report.get('status')}: {str(report.get('error'))[:300]}"}
    if not Path(entry["candidate"]).is_file():
        return {**out, "error": f"no candidate {entry['candidate']}: run `kb generate {entry['spec']} --out DIR` first"}
    spec = common.load_file(entry["spec"], f"kb_bwd_spec_{idx}")
    for j, shape in enumerate(common.bench_shapes(spec, entry.get("shapes"))):
        if time.monotonic() > deadline:
            out["shapes"].append({"shape": shape, "skipped": "deadline"})
            continue
        out["shapes"].append(_run_shape(entry, spec, shape, f"bwd{idx}_{j}", trials, device, deadline))
    return out


# ---- parallel warm-up: compile the backward kernels and FlexAttention's once, in worker processes ---------

def _warm(task: tuple[dict, int, int, str | None]) -> str:
    """Compile one (entry, shape): the emitted training step and FlexAttention's, or (`design`) one backward design."""
    entry, idx, j, design = task
    try:
        spec = common.load_file(entry["spec"], f"kb_bwd_warm_spec_{idx}")
        shape = common.bench_shapes(spec, entry.get("shapes"))[j]
        inputs = _leaf_inputs(common.make_inputs(spec, shape, "cuda"))
        em = _emitted_impl(entry, spec, shape, "cuda", f"bw{idx}_{j}", inputs)
        if design is not None:
            with _backward_design(em.module, parse_design(design).as_tuple()):
                _warm_one(em.impl)
        elif entry.get("backward"):
            _warm_one(em.impl)  # a design sweep times no baseline
        else:
            flex, _ = _flex_impls(spec, inputs, em.model, em.names)
            for impl in (em.impl, flex):
                if impl is not None:
                    _warm_one(impl)
        torch.cuda.synchronize()
        return "ok"
    except Exception as err:
        return f"{type(err).__name__}: {err}"[:200]


def _warm_one(impl: Impl) -> None:
    """One training step and one no-grad forward (each compiles its own kernels); failures are the timed run's."""
    with contextlib.suppress(Exception):
        out = _out(impl.call())
        out.backward(torch.ones_like(out))
        with torch.no_grad():
            impl.call()


def _warm_all(entries: list[dict], workers: int, budget_s: float) -> None:
    tasks = []
    for i, e in enumerate(entries):
        if Path(e["candidate"]).is_file():
            spec = common.load_file(e["spec"], f"kb_bwd_count_spec_{i}")
            designs = [None, *(e["designs"] if e.get("backward") else [])]
            tasks += [(e, i, j, d) for j in range(len(common.bench_shapes(spec, e.get("shapes")))) for d in designs]
    common.warm_in_workers(_warm, tasks, workers, budget_s, log.warning)


# ---- summary and driver ------------------------------------------------------------------------------

def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _ratio_summary(pairs: list[tuple[str, float]]) -> dict:
    low = min(pairs, key=lambda p: p[1], default=None)
    return {"geomean": _geomean([x for _, x in pairs]), "n": len(pairs), "lowest": list(low) if low else None}


def summarize(doc: dict) -> dict:
    """Geomean of x flex (all specs, and the `core` tier alone) and of x sdpa, and what was not timed and why."""
    flex, core, sdpa, not_timed = [], [], [], {}
    for e in doc["entries"]:
        if e.get("error"):
            not_timed[e["name"]] = e["error"][:120]
        for s in e.get("shapes", []):
            em = next((r for r in s.get("records", []) if r["impl"] == "emitted"), None)
            if em is not None and em["status"] != "ok":
                not_timed[e["name"]] = em["status"] + (f": {em['error'][:120]}" if em.get("error") else "")
            if "vs_flex" in s:
                flex.append((e["name"], s["vs_flex"]))
                if e.get("tier") == "core":
                    core.append((e["name"], s["vs_flex"]))
            if "vs_sdpa" in s:
                sdpa.append((e["name"], s["vs_sdpa"]))
    return {"vs_flex": _ratio_summary(flex), "vs_flex_core": _ratio_summary(core), "vs_sdpa": _ratio_summary(sdpa),
            "not_timed": not_timed}


def _fmt_ms(rec: dict | None) -> str:
    if not rec:
        return "-"
    if rec.get("status") != "ok":
        return rec.get("status", "-")
    return f"{rec['ms']:.3f} ms ({rec['tflops']:.0f} TFLOP/s)"


def summary_line(entry: dict, seconds: float) -> str:
    """One line per spec: emitted fwd+bwd (or why not), its worst gradient error, FlexAttention and SDPA, ratios."""
    if entry.get("error"):
        return f"{entry['name']}: ERROR {entry['error']}"
    parts = []
    for s in entry["shapes"]:
        if s.get("skipped"):
            parts.append(f"skipped ({s['skipped']})")
            continue
        recs = {r["impl"]: r for r in s.get("records", [])}
        em = recs.get("emitted", {})
        worst = max(em.get("grad_err", {}).values(), default=math.nan)
        why = f" [{em['error']}]" if em.get("error") else ""
        ratio = "".join(f", {s[k]:.2f}x {b}" for k, b in (("vs_flex", "flex"), ("vs_sdpa", "sdpa")) if k in s)
        head = f"emitted fwd+bwd {_fmt_ms(em)}{why}, grads max rel err {worst:.1e}; "
        designs = [r for r in s.get("records", []) if r["impl"].startswith("design ")]
        if designs:  # a backward design sweep: the best design against the emitted one
            ok = [r for r in designs if r.get("status") == "ok"]
            best = min(ok, key=lambda r: r["ms"], default=None)
            gain = f" ({em['ms'] / best['ms']:.2f}x emitted)" if best and em.get("status") == "ok" else ""
            parts.append(head + f"{len(ok)}/{len(designs)} backward designs ran, best "
                         + (f"{best['design']} {_fmt_ms(best)}{gain}" if best else "none"))
            continue
        first = recs.get("emitted-first-listed")
        first_text = f"first listed {_fmt_ms(first)} ({first.get('design')}), " if first else ""
        parts.append(head + first_text + f"flex {_fmt_ms(recs.get('flex'))}, sdpa {_fmt_ms(recs.get('sdpa'))}{ratio}")
    return f"{entry['name']} [{seconds:.0f}s]: " + "; ".join(parts)


def _totals_line(summary: dict) -> str:
    def one(key: str, label: str) -> str:
        s = summary[key]
        if not s["n"]:
            return f"{label}: none timed"
        return f"{label}: {s['geomean']:.2f}x geomean over {s['n']} (lowest {s['lowest'][1]:.2f}x {s['lowest'][0]})"

    tail = "; ".join(f"{n}: {why}" for n, why in summary["not_timed"].items())
    return " | ".join([one("vs_flex", "x flex"), one("vs_flex_core", "x flex (core)"), one("vs_sdpa", "x sdpa")]) + (
        f" | not timed: {tail}" if tail else "")


def run_plan_backward(plan: dict, out_path: Path, *, deadline_s: float = 300.0, workers: int = 12, trials: int = 20,
                      command: str = "", device: str = "cuda", warm_s: float = 240.0,
                      on_entry: Callable[[dict, float], None] | None = None) -> dict:
    """Time forward+backward for every entry of `plan` on this GPU; `device="cpu"` is a dry run at the specs' small
    shapes (Triton interpreter, wall-clock "times", no FlexAttention) for tests, never a measurement."""
    common.check_run(plan, device, "timing the backward needs a CUDA GPU; run this on the GPU machine")
    entries = plan["entries"]
    if device == "cuda":
        _warm_all(entries, workers, warm_s)
    deadline = time.monotonic() + deadline_s
    env = common.environment(command or " ".join(sys.argv)) if device == "cuda" else {"gpu": "", "arch": "", "dry_run": "cpu"}
    doc: dict[str, Any] = {"schema": SCHEMA, "env": env, "flop_convention": FLOP_CONVENTION, "grad_tol": GRAD_TOL,
                           "entries": []}
    for i, e in enumerate(entries):
        t0 = time.monotonic()
        try:
            doc["entries"].append(_run_entry(e, i, trials, deadline, device))
        except Exception as err:
            doc["entries"].append({"name": e["name"], "spec": e["spec"], "tier": e.get("tier"), "class": e.get("class"),
                                   "error": f"{type(err).__name__}: {str(err)[:500]}", "shapes": []})
        doc["summary"] = summarize(doc)
        common.write_results(out_path, doc)
        if on_entry is not None:
            on_entry(doc["entries"][-1], time.monotonic() - t0)
    return doc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.tune_bwd", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="PLAN.json RESULTS.json, or RESULTS.json with --suite")
    ap.add_argument("--suite", type=Path, help="a suite file (bench/heldout/backward_suite.txt) instead of a plan")
    ap.add_argument("--from", dest="from_dir", type=Path, default=Path("out"), help="with --suite: kb generate's --out")
    ap.add_argument("--tier", choices=("core", "extra"), help="with --suite: only the specs of this tier")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="after the warm-up, start no new entry after this")
    ap.add_argument("--warm-s", type=float, default=240.0, help="at most this long compiling in parallel first")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1), help="parallel compile processes")
    ap.add_argument("--trials", type=int, default=20, help="timed training steps per implementation (median)")
    ap.add_argument("--cpu-dry-run", action="store_true", help="no GPU: the same checks at the specs' small shapes under "
                                                               "TRITON_INTERPRET=1, wall-clock times (not measurements)")
    a = ap.parse_args(argv)
    if len(a.paths) != (1 if a.suite else 2):
        ap.error("give PLAN.json RESULTS.json, or --suite FILE with RESULTS.json")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plan = suite_plan(a.suite, a.from_dir, a.tier) if a.suite else json.loads(a.paths[0].read_text())
    doc = run_plan_backward(plan, a.paths[-1], deadline_s=a.deadline_s, workers=a.workers, trials=a.trials,
                            warm_s=a.warm_s, command="python -m bench.gpu.tune_bwd " + " ".join(argv),
                            device="cpu" if a.cpu_dry_run else "cuda",
                            on_entry=lambda e, s: print(summary_line(e, s), flush=True))
    print(_totals_line(doc["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
