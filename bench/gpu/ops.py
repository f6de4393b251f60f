"""Generated kernels as users call them inside models: compiled, graphed, trained, eager (measuring only).

    PYTHONPATH=. python3 -m bench.gpu.ops --gen DIR [--specs bench/heldout] [--only a,b] [--out DIR]

For each spec `S.py` of --specs whose kernel `kb generate` wrote into --gen (`gen_S.py`, the ModelNew candidate, as
emitted: nothing is re-lowered here), in one process on the GPU, at the spec's BENCH shape in bf16:
- **compile**: a small model (a linear projection of q, then ModelNew) under `torch.compile(fullgraph=True)`, forward
  and backward (of q, k, v, the projection and every learnable parameter of the spec) against the same model eager;
  forward-only kernels check the forward and that backward raises;
- **reduce-overhead**: the same model under `torch.compile(mode="reduce-overhead")` (CUDA graphs), outputs against eager;
- **graph**: ModelNew captured with `torch.cuda.graph` on static inputs, replayed on new inputs copied in;
- **time** (inference, no grad): one eager call's latency (`triton.testing.do_bench`, L2 flushed, median), the
  graphed replay's, back-to-back calls per call (eager and graphed), the host's issue time per eager call (wall time
  of 100 calls before the GPU catches up, divided by 100), and SDPA / compiled FlexAttention where the spec says they
  compute the same. `eager_over_graphed` = eager latency / graphed latency (the goal for decode: <= 1.15).
Writes `<out>/ops_<gpu>.json` (rewritten after every spec) and prints a table last. On a machine without CUDA it
runs the compile checks only, at the spec's small CPU shape under the Triton interpreter (a smoke run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, cast

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU smoke run: before triton is imported (torch._dynamo does)

import torch._dynamo
import torch.nn.functional as F
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

DEFAULT_SPECS = ("decode_mqa", "relative_bias_learned", "causal_d128_bf16", "document_causal")


def load(path: Path, name: str) -> ModuleType:
    """Import `path` as module `name`, registered in sys.modules (Dynamo looks traced functions' modules up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Net(torch.nn.Module):
    """q through a linear projection, then the attention: the kernel inside a model, as users call it."""

    def __init__(self, attention: torch.nn.Module, d: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d, dtype=dtype)
        self.attention = attention

    def forward(self, q, *rest):
        return self.attention(self.proj(q), *rest)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def _models(spec: ModuleType, cand: ModuleType, gpu: bool) -> tuple[torch.nn.Module, torch.nn.Module, list]:
    """(spec Model, ModelNew with the Model's state, forward inputs) at the bench shape (GPU) or the small one."""
    init = spec.bench_init_inputs() if gpu and hasattr(spec, "bench_init_inputs") else spec.get_init_inputs()
    torch.manual_seed(0)
    model = spec.Model(*init)
    new = cand.ModelNew(*init)
    new.load_state_dict(model.state_dict())
    ins = spec.bench_inputs("cuda") if gpu else spec.get_inputs()
    device = "cuda" if gpu else "cpu"
    return model.to(device), new.to(device), [t.to(device) for t in ins]


def _train_step(net: torch.nn.Module, ins: list, dout: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and gradients (float inputs, then every parameter) of one forward + backward."""
    for p in (*ins, *net.parameters()):
        if isinstance(p, torch.Tensor) and p.is_floating_point():
            p.grad = None
    out = net(*ins)
    out.backward(dout)
    return out.detach(), [t.grad for t in ins if t.is_floating_point()] + [p.grad for p in net.parameters()]


def check_compile(new: torch.nn.Module, ins: list, differentiable: bool) -> dict:
    """fullgraph=True against eager, forward and (where the kernel has one) backward; max relative error."""
    net = Net(new, ins[0].shape[-1], ins[0].dtype).to(ins[0].device)
    ins = [t.detach().requires_grad_() if t.is_floating_point() else t for t in ins]
    compiled = cast(torch.nn.Module, torch.compile(net, fullgraph=True))  # compiling a Module gives an OptimizedModule
    if not differentiable:
        with torch.no_grad():
            out, got = net(*ins), compiled(*ins)
        raised = ""
        try:
            compiled(*ins).float().sum().backward()
        except RuntimeError as err:
            raised = str(err).splitlines()[0][:200]
        return {"forward_rel_err": rel_err(got, out), "backward_raises": raised}
    dout = torch.randn_like(net(*ins))
    out, grads = _train_step(net, ins, dout)
    got, cgrads = _train_step(compiled, ins, dout)
    errs = [rel_err(g, w) for g, w in zip(cgrads, grads) if w is not None]
    missing = sum(g is None for g in cgrads) - sum(w is None for w in grads)
    return {"forward_rel_err": rel_err(got, out), "grad_rel_err_max": max(errs), "grads_compared": len(errs),
            "grads_missing": missing}


def check_reduce_overhead(new: torch.nn.Module, ins: list) -> dict:
    net = Net(new, ins[0].shape[-1], ins[0].dtype).to(ins[0].device)
    compiled = torch.compile(net, mode="reduce-overhead", fullgraph=True)
    errs = []
    with torch.no_grad():
        for seed in range(4):  # warm-up runs, the capture, then replays on new inputs
            torch.manual_seed(100 + seed)
            fresh = [torch.randn_like(t) if t.is_floating_point() else t for t in ins]
            errs.append(rel_err(compiled(*fresh), net(*fresh)))
    return {"rel_err_max": max(errs), "calls": len(errs)}


def graph_of(new: torch.nn.Module, ins: list) -> tuple[torch.cuda.CUDAGraph, list, torch.Tensor]:
    """ModelNew captured on static inputs (warmed up on a side stream first, as CUDA graphs need)."""
    static = [t.clone() for t in ins]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            new(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = new(*static)
    return graph, static, out


def check_graph(new: torch.nn.Module, ins: list) -> dict:
    graph, static, out = graph_of(new, ins)
    errs = []
    with torch.no_grad():
        for seed in range(3):
            torch.manual_seed(200 + seed)
            fresh = [torch.randn_like(t) if t.is_floating_point() else t for t in ins]
            for s, f in zip(static, fresh):
                s.copy_(f)
            graph.replay()
            errs.append(rel_err(out, new(*fresh)))
    return {"rel_err_max": max(errs), "replays": len(errs)}


def _per_call_ms(fn: Callable[[], object], n: int = 200) -> float:
    """Back-to-back calls: wall time per call, the GPU kept busy (host overhead hidden where it is shorter)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def _host_issue_us(fn: Callable[[], object], n: int = 100) -> float:
    """The host's time to issue one call: n calls timed before any synchronisation (the launch queue is far from
    full at n = 100), divided by n."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    return issued / n * 1e6


def time_spec(spec: ModuleType, new: torch.nn.Module, ins: list) -> dict:
    def bench(fn: Callable[[], object]) -> float:
        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))

    out: dict = {}
    with torch.no_grad():
        eager = lambda: new(*ins)  # noqa: E731
        graph, _, _ = graph_of(new, ins)
        out["eager_ms"], out["graphed_ms"] = bench(eager), bench(graph.replay)
        out["eager_per_call_ms"], out["graphed_per_call_ms"] = _per_call_ms(eager), _per_call_ms(graph.replay)
        out["host_issue_us"] = _host_issue_us(eager)
        out["eager_over_graphed"] = out["eager_ms"] / out["graphed_ms"]
        sdpa = getattr(spec, "SDPA", None)
        q, k, v = ins[:3]
        if sdpa is not None:
            gqa = q.shape[1] != k.shape[1]
            out["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=sdpa == "causal",
                                                                           enable_gqa=gqa))
        out["flex_ms"] = _flex_ms(spec, ins, new, bench)
    return out


def _flex_ms(spec: ModuleType, ins: list, new: torch.nn.Module, bench: Callable) -> float | None:
    if not hasattr(spec, "flex_mods"):
        return None
    q, k, v = ins[:3]
    try:
        score, mask = spec.flex_mods(*ins)
    except TypeError:
        return None
    block = create_block_mask(mask, None, None, q.shape[2], k.shape[2], device="cuda") if mask is not None else None
    flex = torch.compile(flex_attention, dynamic=False)
    scale = getattr(spec, "SCALE", None)
    gqa = q.shape[1] != k.shape[1]
    return bench(lambda: flex(q, k, v, score_mod=score, block_mask=block, scale=scale, enable_gqa=gqa))


def _env() -> dict:
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = ""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return {"gpu": gpu, "driver": driver, "torch_version": torch.__version__, "triton_version": triton.__version__,
            "command": " ".join(["python3 -m bench.gpu.ops", *sys.argv[1:]]),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "kind": "measured"}


def run_spec(spec_path: Path, gen: Path, gpu: bool) -> dict:
    stem = spec_path.stem
    spec = load(spec_path, f"ops_spec_{stem}")
    cand = load(gen / f"gen_{stem}.py", f"ops_gen_{stem}")
    _, new, ins = _models(spec, cand, gpu)
    differentiable = cand.NO_BACKWARD is None
    row: dict = {"spec": stem, "op": f"kernel_kb.{cand.OP_NAME}", "differentiable": differentiable,
                 "shape": [list(t.shape) for t in ins], "dtype": str(ins[0].dtype)}
    row["compile"] = check_compile(new, ins, differentiable)
    if gpu:
        row["reduce_overhead"] = check_reduce_overhead(new, ins)
        row["graph"] = check_graph(new, ins)
        row["time"] = time_spec(spec, new, ins)
    return row


def table(rows: list[dict]) -> str:
    head = f"{'spec':26} {'compile fwd/grad err':>22} {'graph err':>10} {'eager ms':>9} {'graphed':>8} {'eag/gr':>7} " \
           f"{'host us':>8} {'sdpa':>7} {'flex':>7}"
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['spec']:26} error: {r['error'][:90]}")
            continue
        c, t = r["compile"], r.get("time", {})
        grad = f"{c['grad_rel_err_max']:.1e}" if "grad_rel_err_max" in c else ("raises" if c.get("backward_raises") else "-")
        fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else "-"  # noqa: E731
        lines.append(f"{r['spec']:26} {c['forward_rel_err']:>10.1e}/{grad:>10} {r.get('graph', {}).get('rel_err_max', float('nan')):>10.1e} "
                     f"{fmt(t.get('eager_ms')):>9} {fmt(t.get('graphed_ms')):>8} {fmt(t.get('eager_over_graphed')):>7} "
                     f"{fmt(t.get('host_issue_us')):>8} {fmt(t.get('sdpa_ms')):>7} {fmt(t.get('flex_ms')):>7}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen", type=Path, required=True, help="the --out DIR of `kb generate` for the specs")
    ap.add_argument("--specs", type=Path, default=Path("bench/heldout"))
    ap.add_argument("--only", default=",".join(DEFAULT_SPECS), help="comma-separated spec stems")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    torch._dynamo.config.cache_size_limit = 64
    result: dict[str, Any] = {"schema": "kernel-kb/ops/v1", "env": _env(), "specs": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ops_{'h200' if gpu and 'H200' in torch.cuda.get_device_name() else 'gpu' if gpu else 'cpu'}.json"
    for stem in args.only.split(","):
        try:
            row = run_spec(args.specs / f"{stem}.py", args.gen, gpu)
        except Exception as err:
            row = {"spec": stem, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        result["specs"].append(row)
        path.write_text(json.dumps(result, indent=2, default=str))
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}, default=str), flush=True)
    print(table(result["specs"]))


if __name__ == "__main__":
    main()
