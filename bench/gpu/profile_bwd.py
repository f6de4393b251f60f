"""Where a training step's GPU time goes: per-kernel CUDA time of one forward+backward, ModelNew beside FlexAttention.

    python -m bench.gpu.profile_bwd --suite bench/heldout/backward_suite.txt --from .kbgen/hb15 --only causal_d128_bf16
        document_causal [--steps 5] [--out DIR]
    ncu --kernel-name regex:_bwd_dkdv_kernel --launch-skip 3 --launch-count 1 --set full \
        python -m bench.gpu.profile_bwd ... --only alibi_causal --steps 1 --no-profiler

Each implementation is built as `bench.gpu.tune_bwd` times it (the spec's BENCH shape, the same inputs and
upstream gradient), warmed up, then `steps` training steps run under torch.profiler (CUPTI kernel times, no replay).
Prints, per implementation, the kernels by total GPU time per step, and writes `<out>/profile_bwd.json`.
Not a benchmark: the profiler adds host overhead; kernel times are what it is for. `--no-profiler` runs the same steps
without torch.profiler (whose CUPTI session would collide with an outer `ncu`'s) and prints nothing per kernel.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu import tune_common as common
from bench.gpu.tune_bwd import Impl, _dout, _emitted_impl, _flex_impls, _leaf_inputs, _out, _shape_dims, suite_plan


def _kernels(impl: Impl, dout: torch.Tensor, steps: int, profiled: bool = True) -> list[dict[str, Any]]:
    def step() -> None:
        impl.zero_grads()
        _out(impl.call()).backward(dout)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if not profiled:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if us > 0:
            rows.append({"kernel": ev.key[:120], "us_per_step": us / steps, "calls_per_step": ev.count / steps})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", type=Path, required=True)
    ap.add_argument("--from", dest="from_dir", type=Path, required=True)
    ap.add_argument("--only", nargs="+", required=True, help="spec stems of the suite to profile")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-profiler", action="store_true", help="run the steps unprofiled (under an outer ncu)")
    args = ap.parse_args()
    entries = {e["name"]: e for e in suite_plan(args.suite, args.from_dir)["entries"]}
    doc: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "specs": {}}
    for name in args.only:
        entry = entries[name]
        spec = common.load_file(entry["spec"], f"kb_profile_spec_{name}")
        shape = common.bench_shapes(spec, None)[0]
        inputs = _leaf_inputs(common.make_inputs(spec, shape, "cuda"))
        em = _emitted_impl(entry, spec, shape, "cuda", name, inputs)
        dims = _shape_dims(inputs)
        dout = _dout((dims["B"], dims["Hq"], dims["M"], dims.get("Dv", dims["D"])), inputs[0].dtype, "cuda")
        flex, _ = _flex_impls(spec, inputs, em.model, em.names)
        profiled = not args.no_profiler
        doc["specs"][name] = {"shape": dims, "emitted": _kernels(em.impl, dout, args.steps, profiled),
                              "flex": _kernels(flex, dout, args.steps, profiled) if flex is not None else None}
        for impl in ("emitted", "flex"):
            rows = doc["specs"][name][impl] or []
            print(f"== {name} {impl}: {sum(r['us_per_step'] for r in rows) / 1e3:.3f} ms of kernels per step")
            for r in rows[:12]:
                print(f"  {r['us_per_step'] / 1e3:8.3f} ms  x{r['calls_per_step']:.0f}  {r['kernel']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_bwd.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
