"""The GPU half of `kb tune`: time a generated kernel's designs beside FlexAttention and SDPA, in one process.

    python -m bench.gpu.tune PLAN.json RESULTS.json [--deadline-s 540] [--workers 12]
    python -m bench.gpu.tune --backward PLAN.json RESULTS.json      (forward+backward: bench.gpu.tune_bwd)

A plan (written by `kb tune --plan`, or built in-process by `kb tune` on a GPU machine) lists entries:
the spec file, the candidate file `kb generate` wrote (`ModelNew` + the Triton module's `forward`), the
kernel's IR record, the shapes to time at (default: the spec's `BENCH`) and the designs to try, in order.
For each entry and shape this times, on the same bf16 inputs:
- `emitted`: `ModelNew(*init)(*inputs)` exactly as a user calls the candidate (the module picks its design);
- `emitted+table`: for data-dependent masks, the module's `forward` with its block table built once
  (as FlexAttention's block mask is), labelled separately;
- every design of the plan through the same module (`forward(..., _design=d)`), each checked against
  the reference output first (a design with the wrong answer is recorded as `wrong`, never timed);
- `flex` (torch.compile'd flex_attention with `create_block_mask` built once) from the spec's
  `flex_mods`, and `sdpa` where the spec says SDPA computes the same thing;
- with `--flex-flash`, `flex-flash`: the same FlexAttention call with `kernel_options={"BACKEND": "FLASH"}`
  (FlashAttention-4's CuTe DSL kernels; needs `flash-attn-4` installed), checked like a design.
The reference is FlexAttention's output where the spec gives `flex_mods`, else SDPA's, else the spec's
own Model. Compilation runs first in parallel worker processes sharing Triton's and Inductor's caches,
so the timed process only loads kernels. Results are written after every entry (schema
`kernel-kb/tune/v1`), so a run cut short keeps what it measured. Needs torch and triton, not the KB.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from bench.gpu.tune_common import (PLAN_SCHEMA, attended_pairs, bench_shapes, check_run, environment, first_listed,
                                      flex_call, load_candidate, load_file, make_inputs, output_ok, picked_design, sdpa_call,
                                      spec_mods, sync, time_call, warm_in_workers, write_results)
from bench.gpu.tune_bwd import main as backward_main
from bench.gpu.tune_bwd import run_plan_backward
from generate.tune_schema import SCHEMA, impl_ms
from kb.ir.design import head_bucket, parse_design
from kb.ir.text import parse_program
from kb.lower.cuda_build import BuildMode, build
from kb.lower.cuda_runtime import CudaKernel, device_arch

# PLAN_SCHEMA, environment and bench_shapes live in bench.gpu.tune_common (the backward timer's too); exported here as before
__all__ = ["SCHEMA", "PLAN_SCHEMA", "run_plan", "time_plan", "environment", "bench_shapes", "impl_ms", "module_call"]



class _Recorder:
    """Stands in for a module function once, to learn the arguments ModelNew passes it and what it returned."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}
        self.out: Any = None

    def __call__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        self.out = self.fn(*args, **kwargs)
        return self.out


def module_call(cand: ModuleType, new: torch.nn.Module, inputs: list) -> tuple[tuple, dict, Any, str]:
    """forward()'s arguments as ModelNew passes them, ModelNew's output, and which implementation answered (the
    module's `.cu`, whose dispatch `_cuda_forward(q, k, v, sm_scale, named)` returns None when it declines and a call
    it answers never reaches forward(), or its Triton kernels)."""
    recs = {name: _Recorder(getattr(cand, name)) for name in ("forward", "_cuda_forward") if hasattr(cand, name)}
    for name, rec in recs.items():
        setattr(cand, name, rec)
    try:
        with torch.no_grad():
            out = new(*inputs)
    finally:
        for name, rec in recs.items():
            setattr(cand, name, rec.fn)
    cuda = recs.get("_cuda_forward")
    if cuda is not None and cuda.out is not None:
        q, k, v, sm_scale, named = cuda.args
        return (q, k, v), {"sm_scale": sm_scale, **named}, out, ".cu"
    return recs["forward"].args, recs["forward"].kwargs, out, "triton"


# ---- the reference and one implementation's record --------------------------------------------------------------------

def _dense_reference(spec: ModuleType, inputs: list, model: torch.nn.Module) -> torch.Tensor | None:
    """Attention in fp32 from the spec's `flex_mods`, evaluated densely in row chunks (no compiler involved):
    the reference every implementation, FlexAttention included, is checked against."""
    mods = spec_mods(spec, inputs, model)
    if mods is None:
        return None
    score_mod, mask_mod = mods
    q, k, v = inputs[:3]
    B, Hq, M, D = q.shape
    N, r = k.shape[2], q.shape[1] // k.shape[1]
    scale = getattr(spec, "SCALE", None) or 1.0 / math.sqrt(D)
    dev = q.device
    out = torch.empty(B, Hq, M, v.shape[-1], dtype=torch.float32, device=dev)
    h_idx = torch.arange(Hq, device=dev).view(-1, 1, 1)
    kv_idx = torch.arange(N, device=dev).view(1, 1, -1)
    rows = max(1, (1 << 27) // (Hq * N))  # about 512 MB of fp32 scores per chunk
    for b in range(B):
        kb_ = k[b].float().repeat_interleave(r, 0)
        vb = v[b].float().repeat_interleave(r, 0)
        bt = torch.tensor(b, device=dev)
        for r0 in range(0, M, rows):
            q_idx = torch.arange(r0, min(M, r0 + rows), device=dev).view(1, -1, 1)
            s = (q[b, :, r0:r0 + rows].float() @ kb_.transpose(-1, -2)) * scale
            if score_mod is not None:
                s = score_mod(s, bt, h_idx, q_idx, kv_idx).float()
            if mask_mod is not None:
                s = s.masked_fill(~torch.as_tensor(mask_mod(bt, h_idx, q_idx, kv_idx)).bool(), float("-inf"))
            p = torch.softmax(s, -1).nan_to_num(0.0)  # fully masked rows attend to nothing: 0
            out[b, :, r0:r0 + rows] = p @ vb
    return out


def _record(label: str, fn: Callable[[], Any] | None, ref: torch.Tensor | None, flops: float, trials: int,
            check: bool = True) -> dict:
    rec: dict[str, Any] = {"impl": label}
    if fn is None:
        return {**rec, "status": "n/a"}
    try:
        out = fn()
        sync()
        if ref is not None:
            o = out[0] if isinstance(out, tuple) else out
            rec["max_abs_err"] = float((o.float() - ref.float()).abs().max())
            if check and not output_ok(o.float(), ref.float()):
                return {**rec, "status": "wrong"}
        ms, iqr, n = time_call(fn, trials)
        return {**rec, "status": "ok", "ms": ms, "iqr_ms": iqr, "trials": n, "tflops": flops / ms / 1e9}
    except Exception as err:
        return {**rec, "status": "error", "error": f"{type(err).__name__}: {str(err)[:300]}"}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _flash_record(spec: ModuleType, inputs: list, model: torch.nn.Module, ref: torch.Tensor | None, flops: float,
                  trials: int) -> dict:
    """FlexAttention's FLASH backend as a baseline, checked against the reference; where it does not run (no
    flash-attn-4, a mod or shape it does not take) the record says why."""
    try:
        fn = flex_call(spec, inputs, model, backend="FLASH")
    except Exception as err:
        return {"impl": "flex-flash", "status": "error", "error": f"{type(err).__name__}: {str(err)[:300]}"}
    return _record("flex-flash", fn, ref, flops, trials)


def _run_entry(entry: dict, idx: int, trials: int, deadline: float, device: str, flex_flash: bool = False) -> dict:
    spec = load_file(entry["spec"], f"kb_tune_spec_{idx}")
    out: dict[str, Any] = {"name": entry["name"], "spec": entry["spec"], "candidate": entry["candidate"],
                           "kernel": entry.get("kernel"), "shapes": []}
    for j, shape in enumerate(bench_shapes(spec, entry.get("shapes"))):
        if time.monotonic() > deadline:
            out["shapes"].append({"shape": shape, "skipped": "deadline"})
            continue
        out["shapes"].append(_run_shape(entry, spec, shape, f"{idx}_{j}", trials, deadline, device, flex_flash))
    return out


def _run_shape(entry: dict, spec: ModuleType, shape: dict, tag: str, trials: int, deadline: float, device: str,
               flex_flash: bool = False) -> dict:
    if device == "cpu":
        shape = {}  # the CPU dry run works at the spec's own small shape
    inputs = make_inputs(spec, shape, device)
    cand, model, new = load_candidate(entry, spec, shape, device, tag)
    q, k, v = inputs[:3]
    dims = {"B": q.shape[0], "Hq": q.shape[1], "Hkv": k.shape[1], "M": q.shape[2], "N": k.shape[2], "D": q.shape[3]}
    if v.shape[3] != q.shape[3]:
        dims["Dv"] = v.shape[3]  # value heads of their own width (recorded only then)
    pairs = attended_pairs(spec, inputs, model)
    flops = 2.0 * dims["Hq"] * (dims["D"] + dims.get("Dv", dims["D"])) * pairs  # q @ k^T and p @ v per attended pair
    res: dict[str, Any] = {"shape": {**dims, "attended_pairs": pairs, "flops": flops}, "dtype": str(q.dtype).split(".")[-1]}
    res["shape"]["kv_bytes"] = sum(t.numel() * t.element_size() for t in inputs[1:3])  # decode reads K and V once
    try:
        flex = flex_call(spec, inputs, model) if device == "cuda" else None
    except Exception as err:
        flex, res["flex_error"] = None, f"{type(err).__name__}: {str(err)[:300]}"
    sdpa = sdpa_call(spec, inputs)
    with torch.no_grad():
        ref = _dense_reference(spec, inputs, model)
        res["reference"] = "dense fp32 from flex_mods"
        if ref is None:
            ref = sdpa() if sdpa is not None else model(*inputs)
            res["reference"] = "sdpa" if sdpa is not None else "spec Model"
        args, kwargs, _, res["emitted_runs"] = module_call(cand, new, inputs)
        res["emitted_design"] = picked_design(cand)
        records = [_record("emitted", lambda: new(*inputs), ref, flops, trials),
                   {**_record("emitted-cuda", _emitted_cuda(entry, args, kwargs), ref, flops, trials),
                    "lowering": _cuda_lowering(entry)},
                   _record("flex", flex, ref, flops, trials, check=False), _record("sdpa", sdpa, ref, flops, trials, check=False)]
        if device == "cuda":  # the ablation: what the module ran before it timed its listed designs
            with first_listed(cand):
                records.append({**_record("emitted-first-listed", lambda: new(*inputs), ref, flops, trials),
                                "design": picked_design(cand)})
        if flex_flash and device == "cuda":
            records.append(_flash_record(spec, inputs, model, ref, flops, trials))
        table = getattr(cand, "block_class_table", None)
        for text in entry["designs"]:
            if time.monotonic() > deadline:
                records.append({"impl": f"design {text}", "design": text, "status": "skipped", "error": "deadline"})
                continue
            d = _design_arg(text)
            kw = dict(kwargs)
            if table is not None:
                with contextlib.suppress(Exception):  # a design that cannot build its table fails below
                    kw["block_class"] = table(*args, _design=d, **kwargs)
            fn = functools.partial(cand.forward, *args, _design=d, **kw)
            records.append({**_record(f"design {text}", fn, ref, flops, trials), "design": text})
        if table is not None and res["emitted_design"]:
            d = _design_arg(res["emitted_design"])
            kw = {**kwargs, "block_class": table(*args, _design=d, **kwargs)}
            records.append(_record("emitted+table", functools.partial(cand.forward, *args, _design=d, **kw), ref, flops,
                                   trials))
    res["records"] = records
    return res


def _cuda_build_args(entry: dict, head_dim: int) -> tuple[Path, Path, tuple[str, ...]] | None:
    """(.cu, .kbir, nvcc defines) of the CUDA source emitted beside the candidate, if there is one."""
    cand = Path(entry["candidate"])
    cu, ir = cand.with_suffix(".cu"), cand.with_suffix(".kbir")
    if not (cu.is_file() and ir.is_file()):
        return None
    return cu, ir, (f"KB_HEAD_PAD_ONLY={head_bucket(head_dim)}",)


def _cuda_lowering(entry: dict) -> str | None:
    """Which CUDA lowering wrote the emitted `.cu` (from its report beside it), or None without one."""
    report = Path(entry["candidate"]).with_suffix(".report.json")
    try:
        return json.loads(report.read_text()).get("cuda", {}).get("lowering")
    except (OSError, ValueError):
        return None


def _build_cuda_all(entries: list[dict], workers: int) -> None:
    """nvcc every emitted `.cu` in parallel first (cached by content), so timing only loads libraries."""
    def one(entry: dict) -> str:
        shapes = entry.get("shapes") or [{}]
        found = _cuda_build_args(entry, int(shapes[0].get("D", 128)))
        if found is None:
            return f"{entry['name']}: no .cu"
        cu, ir, defines = found
        res = build(cu.read_text(), cu.parent / "cuda-build", BuildMode.SHARED, name=parse_program(ir.read_text()).name,
                    arch=device_arch(), defines=defines)
        return f"{entry['name']}: {res.status.value} ({res.seconds:.0f} s)"

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:  # nvcc runs outside the GIL
        done = list(pool.map(one, entries))
    print(f"built the emitted .cu files in {time.monotonic() - t0:.0f} s: " + "; ".join(done), flush=True)


def _emitted_cuda(entry: dict, args: tuple, kwargs: dict) -> Callable[[], Any] | None:
    """The `.cu` that `kb generate` wrote beside the candidate, built with nvcc for this GPU as it is and
    called through its `kb_launch` ABI on the arguments ModelNew passed the Triton module; None without one."""
    found = _cuda_build_args(entry, args[0].shape[-1])
    if found is None or not torch.cuda.is_available():
        return None
    cu, ir, defines = found
    try:
        kern = CudaKernel.from_source(parse_program(ir.read_text()), cu.read_text(), cu.parent / "cuda-build",
                                      defines=defines)
    except Exception as err:
        failure = err

        def fail() -> None:
            raise failure
        return fail
    inputs = {"q": args[0], "k": args[1], "v": args[2],
              **{n: x for n, x in kwargs.items() if x is not None and not n.startswith("_")}}
    return lambda: kern.run(inputs)["o"]


def entry_impls(entry: dict, shape_index: int = 0, device: str = "cuda") -> dict[str, Callable[[], Any]]:
    """What one plan entry times at one of its shapes, as zero-argument calls: `emitted` (ModelNew as a user
    calls it), `flex`, `sdpa` where they apply, and `design TEXT` for each of the entry's designs. For
    profilers (bench.gpu.profile); no reference, no checks."""
    spec = load_file(entry["spec"], "kb_profile_spec")
    shape = bench_shapes(spec, entry.get("shapes"))[shape_index] if device != "cpu" else {}  # CPU: the small shape
    inputs = make_inputs(spec, shape, device)
    cand, model, new = load_candidate(entry, spec, shape, device, "profile")
    args, kwargs, _, _ = module_call(cand, new, inputs)
    impls: dict[str, Callable[[], Any] | None] = {
        "emitted": lambda: new(*inputs), "flex": flex_call(spec, inputs, model), "sdpa": sdpa_call(spec, inputs),
        "emitted-cuda": _emitted_cuda(entry, args, kwargs) if device == "cuda" else None}
    for text in entry["designs"]:
        impls[f"design {text}"] = functools.partial(cand.forward, *args, _design=_design_arg(text), **kwargs)
    return {name: fn for name, fn in impls.items() if fn is not None}


def _design_arg(text: str) -> tuple:
    """The `_design=` tuple of a design's text; 6 entries unless it packs, so candidates emitted before GQA
    packing (whose launch unpacks 6) time as before."""
    d = parse_design(text)
    return d.as_tuple() if d.pack_gqa else d.as_tuple()[:6]


# ---- parallel warm-up (compile everything once, in worker processes) -----------------------------

def _warm(task: tuple[dict, int, int, str | None]) -> str:
    entry, idx, j, design = task
    try:
        spec = load_file(entry["spec"], f"kb_warm_spec_{idx}")
        shape = bench_shapes(spec, entry.get("shapes"))[j]
        inputs = make_inputs(spec, shape, "cuda")
        cand, model, new = load_candidate(entry, spec, shape, "cuda", f"w{idx}_{j}")
        with torch.no_grad():
            if design is None:
                flex = flex_call(spec, inputs, model)
                if flex is not None:
                    flex()
                new(*inputs)
            else:
                args, kwargs, _, _ = module_call(cand, new, inputs)
                cand.forward(*args, _design=_design_arg(design), **kwargs)
        torch.cuda.synchronize()
        return "ok"
    except Exception as err:
        return f"{type(err).__name__}: {err}"[:200]


def _warm_all(entries: list[dict], workers: int, budget_s: float) -> None:
    tasks = []
    for i, e in enumerate(entries):
        spec = load_file(e["spec"], f"kb_count_spec_{i}")
        for j in range(len(bench_shapes(spec, e.get("shapes")))):
            tasks.append((e, i, j, None))
            tasks += [(e, i, j, d) for d in e["designs"]]
    warm_in_workers(_warm, tasks, workers, budget_s, lambda line: print(line, flush=True))


# ---- driver -------------------------------------------------------------------------------------

def time_plan(plan: dict, out_path: Path, *, backward: bool = False, command: str = "", device: str = "cuda") -> dict:
    """`plan` timed on this GPU: its designs (`run_plan`), or as training steps (`backward`: bench.gpu.tune_bwd); what
    `kb tune` and its Ray campaign (generate.campaign, which takes the timer as an argument) run."""
    return (run_plan_backward if backward else run_plan)(plan, out_path, command=command, device=device)


def run_plan(plan: dict, out_path: Path, *, deadline_s: float = 540.0, workers: int = 12, trials: int = 30,
             command: str = "", device: str = "cuda", warm_s: float = 240.0, flex_flash: bool = False) -> dict:
    """Time every entry of `plan` on this GPU; `device="cpu"` is a dry run of the same code at the specs' small
    shapes under the Triton interpreter (no baselines but SDPA, wall-clock "times"; for tests, never imported)."""
    check_run(plan, device, "kb tune needs a CUDA GPU; run this where one is, then `kb perf import` the results")
    entries = plan["entries"]
    if device == "cuda":
        _warm_all(entries, workers, warm_s)
        _build_cuda_all(entries, workers)
    deadline = time.monotonic() + deadline_s  # for the timing; the warm-up has its own budget (run 7 lost its
    # whole deadline to compiling)
    env = environment(command or " ".join(sys.argv)) if device == "cuda" else {"gpu": "", "arch": "", "dry_run": "cpu"}
    doc: dict[str, Any] = {"schema": SCHEMA, "env": env, "entries": []}
    for i, e in enumerate(entries):
        t0 = time.monotonic()
        try:
            doc["entries"].append(_run_entry(e, i, trials, deadline, device, flex_flash))
        except Exception as err:
            doc["entries"].append({"name": e["name"], "spec": e["spec"], "kernel": e.get("kernel"),
                                   "error": f"{type(err).__name__}: {str(err)[:500]}", "shapes": []})
        write_results(out_path, doc)
        print(_summary_line(doc["entries"][-1], time.monotonic() - t0), flush=True)
    return doc


def _summary_line(entry: dict, seconds: float) -> str:
    if entry.get("error"):
        return f"{entry['name']}: ERROR {entry['error']}"
    parts = []
    for s in entry["shapes"]:
        recs = {r["impl"]: r for r in s.get("records", [])}
        best = min((r for r in s.get("records", []) if r["impl"].startswith("design") and r["status"] == "ok"),
                   key=lambda r: r["ms"], default=None)
        em, fx, sd, fl, first = (recs.get(k, {}) for k in ("emitted", "flex", "sdpa", "flex-flash", "emitted-first-listed"))
        runs = "the .cu" if s.get("emitted_runs") == ".cu" else s.get("emitted_design")
        parts.append(f"D{s.get('shape', {}).get('D')}: emitted {em.get('ms', math.nan):.3f} ms ({runs}), "
                     + (f"first listed {first['ms']:.3f} ({first.get('design')}), " if "ms" in first else "") +
                     f"best {best['ms'] if best else math.nan:.3f} ({best['design'] if best else '-'}), "
                     f"flex {fx.get('ms', math.nan):.3f}, sdpa {sd.get('ms', math.nan):.3f}"
                     + (f", flex-flash {fl['ms']:.3f}" if "ms" in fl else f", flex-flash {fl['status']}" if fl else ""))
    return f"{entry['name']} [{seconds:.0f}s]: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--backward" in argv:  # forward+backward instead: bench.gpu.tune_bwd, with its own options
        return backward_main([a for a in argv if a != "--backward"])
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backward", action="store_true",
                    help="time forward+backward (python -m bench.gpu.tune_bwd; see its --help for its options)")
    ap.add_argument("plan", type=Path)
    ap.add_argument("results", type=Path)
    ap.add_argument("--deadline-s", type=float, default=300.0,
                    help="after the warm-up, stop starting new timing work after this many seconds")
    ap.add_argument("--warm-s", type=float, default=240.0, help="at most this long compiling in parallel first")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1), help="parallel compile processes")
    ap.add_argument("--trials", type=int, default=30, help="timed calls per implementation (median reported)")
    ap.add_argument("--flex-flash", action="store_true",
                    help="also time FlexAttention's FLASH backend (flash-attn-4's CuTe DSL kernels) beside its Triton one")
    a = ap.parse_args(argv)
    plan = json.loads(a.plan.read_text())
    run_plan(plan, a.results, deadline_s=a.deadline_s, workers=a.workers, trials=a.trials, warm_s=a.warm_s,
             command="python -m bench.gpu.tune " + " ".join(argv), flex_flash=a.flex_flash)
    return 0


if __name__ == "__main__":
    sys.exit(main())
