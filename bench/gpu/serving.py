"""Generated serving kernels on a GPU, as users call them (measuring only).

    PYTHONPATH=. python3 -m bench.gpu.serving --gen DIR [--specs bench/heldout_serving] [--out DIR]

For each spec S of --specs with a `gen_S.py` that `kb generate` wrote into --gen: the spec's `bench_inputs("cuda")`
(its BENCH shape, the engine's layout), `Model(*bench_init_inputs())` and `ModelNew` with the Model's state loaded.
ModelNew's output is compared with the Model's (fp32 math on the same inputs), then timed eager and as a CUDA graph
replay (`triton.testing.do_bench`, median ms); the Model itself (torch: gathers the whole cache, then dense attention)
is timed beside it. For decode, bandwidth counts the K and V bytes of each sequence's keys once (what a decode kernel
must read), so GB/s against the GPU's HBM peak says how far the kernel is from the roofline; for packed and chunked
prefill, TFLOP/s of the full per-sequence products (a chunk's queries times its sequence's context). A spec with a
`WINDOW` has each sequence's keys clipped to the window (the keys its query can see).

`--sweep` also times each paged decode ModelNew at batch 64 and 256 with 4K and 32K tokens per sequence (uniform
lengths, random page tables, built on the GPU), graphed, against the measured device-to-device copy bandwidth
(`environment()["copy_gbps"]`, bytes read + written). `--designs "16x16 w4 s2 split8;..."` adds, at each sweep
point, the module's `forward(..., _design=d)` for each design (an ablation of the schedule, labelled by its text;
its output compared with the module's own design's); `--prefill-designs` does the same for the packed and chunked
prefill modules at their bench shapes. Writes `<out>/serving_<gpu>.json`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import triton.testing

from bench.gpu.serving_baselines import VLLM_OPS, baselines
from bench.gpu.tune import environment, module_call
from kb.ir.design import parse_design
from kb.lower.runtime import import_file


def check(path: Path, gen: Path, vllm_src: Path | None = None, designs: tuple[str, ...] = ()) -> dict:
    spec = import_file(path, f"spec_{path.stem}")
    cand = import_file(gen / f"gen_{path.stem}.py", f"cand_{path.stem}")
    init = list(getattr(spec, "bench_init_inputs", spec.get_init_inputs)())
    inputs = spec.bench_inputs("cuda")
    model = spec.Model(*init).cuda()
    new = cand.ModelNew(*init).cuda()
    new.load_state_dict(model.state_dict())
    q, k_cache, lengths = inputs[0], inputs[1], inputs[-1]
    res: dict = {"spec": path.stem, "bench": spec.BENCH, "dtype": str(q.dtype)}
    packed = k_cache.dim() == 3 and isinstance(inputs[3], torch.Tensor) and inputs[3].dim() == 1 and q.dim() == 3 \
        and inputs[3].numel() < q.shape[0]
    named = dict(zip(list(inspect.signature(spec.Model.forward).parameters)[1:], inputs))
    chunked = "query_start_loc" in named  # packed new tokens against the paged cache (vLLM's form)
    if packed:  # the Model's fp32 scores over every (query, key) pair of the packed batch
        model_gb = 4 * q.shape[1] * q.shape[0] * k_cache.shape[0] / 1e9
    else:  # its gathered, head-repeated fp32 K and V: [B, Hq, MAX_PAGES * PAGE, D] each
        table = inputs[3]
        n = table.shape[1] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
        model_gb = 2 * 4 * q.shape[0] * q.shape[1] * n * q.shape[-1] / 1e9
    run_model = model_gb < 40
    with torch.no_grad():
        got = new(*inputs)
        if run_model:
            want = model(*inputs)
            torch.cuda.synchronize()
            res["max_abs_vs_model"] = (got.float() - want.float()).abs().max().item()
            del want
        else:
            res["model"] = f"not run: its dense fp32 tensors would take {model_gb:.0f} GB"
        timed = _timed(lambda: new(*inputs))
        res["graphed_max_abs"] = timed.pop("graphed_max_abs")
        res.update(timed)
        res["baselines"] = _baselines(spec, model, inputs, got, vllm_src, res.get("graph_ms"))
        if run_model:
            res["model_ms"] = triton.testing.do_bench(lambda: model(*inputs), warmup=5, rep=50)
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    ms = _ms(res)
    if run_model:
        res["vs_model"] = res["model_ms"] / ms
    if packed or chunked:  # FLOPs of the full per-sequence products, 4 * Hq * D * len_q * len_k (no causal halving)
        if chunked:
            lq, lk = named["query_start_loc"].long().diff(), named["seq_lens"].long()
        else:
            lq, lk = (x[1:] - x[:-1] for x in (inputs[3].long(), inputs[4].long()))
        tflop = 4 * q.shape[1] * d * int((lq * lk).sum()) / 1e12

        def rate(t: float) -> dict:
            return {"tflops_per_s": tflop / (t / 1e3)}
    else:
        def rate(t: float) -> dict:
            return _bandwidth(spec, lengths, hkv, d, k_cache.element_size(), t)
    res.update(rate(ms))
    if designs:
        with torch.no_grad():
            res["designs"] = _design_rows(cand, new, inputs, designs, rate)
    return res


def _timed(fn: Callable[[], torch.Tensor]) -> dict:
    """Eager and CUDA-graph-replay medians of fn (warmed outside the capture); a capture that fails is a result."""
    out = fn()
    res: dict = {"eager_ms": triton.testing.do_bench(fn, warmup=25, rep=200)}
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph = fn()
        graph.replay()
        torch.cuda.synchronize()
        res["graphed_max_abs"] = (o_graph.float() - out.float()).abs().max().item()
        res["graph_ms"] = triton.testing.do_bench(graph.replay, warmup=25, rep=200)
    except Exception as err:
        res["graphed_max_abs"], res["graph_error"] = None, f"{type(err).__name__}: {err}"[:300]
    return res


def _ms(row: dict) -> float:
    """The graph replay's median where the capture worked, else the eager one."""
    return row.get("graph_ms") or row["eager_ms"]


def _baselines(spec: ModuleType, model: torch.nn.Module, inputs: list, got: torch.Tensor, vllm_src: Path | None,
               new_graph_ms: float | None) -> dict:
    """vLLM's unified_attention and FlexAttention on the same tensors: error against ModelNew's output, times, and
    ModelNew's speed-up over each (graph replay against graph replay where both capture, else eager)."""
    out: dict = {}
    try:
        found = baselines(spec, model, inputs, vllm_src)
    except Exception as err:  # a baseline that cannot load (a wrong --vllm-src) must not lose ModelNew's own times
        return {"error": f"{type(err).__name__}: {err}"[:500]}
    for name, (fn, note) in found.items():
        row: dict = {"note": note}
        if fn is not None:
            try:
                row["max_abs_vs_new"] = (fn().float() - got.float()).abs().max().item()
                row.update(_timed(fn))
                ms = _ms(row)
                if new_graph_ms:
                    row["new_speedup"] = ms / new_graph_ms
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:500]
        out[name] = row
        torch.cuda.empty_cache()
    return out


def _bandwidth(spec: object, lengths: torch.Tensor, hkv: int, d: int, elem: int, ms: float) -> dict:
    keys = lengths.long()
    window = getattr(spec, "WINDOW", None)
    if window is not None:
        keys = keys.clamp(max=window)
    kv_bytes = 2 * int(keys.sum()) * hkv * d * elem
    return {"kv_gbytes": kv_bytes / 1e9, "graph_gb_per_s": kv_bytes / 1e9 / (ms / 1e3)}


def _decode_inputs(shape: dict, batch: int, context: int) -> list:
    """vLLM's paged decode tensors (the spec's BENCH heads and page size) at one uniform context, built on the GPU
    (a 32K x 256 cache is ~34 GB)."""
    hq, hkv, d, page = shape["Hq"], shape["Hkv"], shape["D"], shape["PAGE"]
    pages = context // page
    g = torch.Generator(device="cuda").manual_seed(0)
    table = torch.randperm(batch * pages, generator=g, device="cuda").reshape(batch, pages).to(torch.int32)
    k_cache = torch.randn(batch * pages, page, hkv, d, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
    return [q, k_cache, v_cache, table, torch.full((batch,), context, dtype=torch.int32, device="cuda")]


def sweep(path: Path, gen: Path, copy_gbps: float, vllm_src: Path | None, batches: tuple[int, ...] = (64, 256),
          contexts: tuple[int, ...] = (4096, 32768), designs: tuple[str, ...] = ()) -> list[dict]:
    spec = import_file(path, f"spec_{path.stem}")
    cand = import_file(gen / f"gen_{path.stem}.py", f"cand_{path.stem}")
    init = list(getattr(spec, "bench_init_inputs", spec.get_init_inputs)())
    model = spec.Model(*init).cuda()
    new = cand.ModelNew(*init).cuda()
    new.load_state_dict(model.state_dict())
    rows = []
    for batch in batches:
        for context in contexts:
            inputs = _decode_inputs(spec.BENCH, batch, context)
            with torch.no_grad():
                got = new(*inputs)

                def call(x: list = inputs) -> torch.Tensor:  # this iteration's inputs, bound here (deleted below)
                    return new(*x)

                row = {"spec": path.stem, "batch": batch, "context": context, **_timed(call)}
                ms = _ms(row)
                row.update(_bandwidth(spec, inputs[-1], spec.BENCH["Hkv"], spec.BENCH["D"], 2, ms))
                row["of_copy_bandwidth"] = row["graph_gb_per_s"] / copy_gbps
                row["baselines"] = _baselines(spec, model, inputs, got, vllm_src, row.get("graph_ms"))
                if designs:
                    def rate(t: float, lengths: torch.Tensor = inputs[-1]) -> dict:
                        bw = _bandwidth(spec, lengths, spec.BENCH["Hkv"], spec.BENCH["D"], 2, t)
                        return {**bw, "of_copy_bandwidth": bw["graph_gb_per_s"] / copy_gbps}

                    row["designs"] = _design_rows(cand, new, inputs, designs, rate)
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
            del inputs, got
            torch.cuda.empty_cache()
    return rows


def _design_rows(cand: ModuleType, new: torch.nn.Module, inputs: list, designs: tuple[str, ...],
                 rate: Callable[[float], dict]) -> dict:
    """The Triton module's forward with each design forced, on the arguments ModelNew passes it, graphed; `rate`:
    the row's GB/s or TFLOP/s from its ms."""
    args, kwargs, _, ran = module_call(cand, new, inputs)
    if ran != "triton":
        return {"error": f"ModelNew ran the {ran}, not the Triton module"}
    own = cand.forward(*args, **kwargs)[0]
    out: dict = {}
    for text in designs:
        design = parse_design(text).as_tuple()

        def call(d: tuple = design) -> torch.Tensor:
            return cand.forward(*args, _design=d, **kwargs)[0]

        try:
            row: dict = {"max_abs_vs_own": (call().float() - own.float()).abs().max().item(), **_timed(call)}
            row.update(rate(_ms(row)))
        except Exception as err:
            row = {"error": f"{type(err).__name__}: {err}"[:300]}
        out[text] = row
        torch.cuda.empty_cache()
    return out


def _designs(text: str) -> tuple[str, ...]:
    return tuple(d.strip() for d in text.split(";") if d.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gen", type=Path, required=True, help="kb generate's --out directory")
    ap.add_argument("--specs", type=Path, default=Path("bench/heldout_serving"))
    ap.add_argument("--out", type=Path, default=Path("out/serving"))
    ap.add_argument("--sweep", action="store_true", help="also time paged decode at batch 64/256 x 4K/32K tokens")
    ap.add_argument("--designs", default="", help="with --sweep: designs to force on each decode module at every "
                                                   "sweep point, ';'-separated (e.g. '16x16 w4 s2 split8;16x16 w4 s3 "
                                                   "split16'), an ablation")
    ap.add_argument("--prefill-designs", default="", help="designs to force on each packed or chunked prefill module "
                                                          "at its bench shape, ';'-separated (e.g. '128x128 w8 s1'), "
                                                          "an ablation")
    ap.add_argument("--vllm-src", type=Path, default=None,
                    help="a directory holding vllm/v1/attention/ops/ of the pinned vLLM wheel (the KB cache's copy)")
    args = ap.parse_args()
    if args.vllm_src is not None and not (args.vllm_src / VLLM_OPS / "triton_unified_attention.py").is_file():
        ap.error(f"--vllm-src {args.vllm_src} holds no {VLLM_OPS}/triton_unified_attention.py (give the directory "
                 "that holds vllm/)")
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment("python -m bench.gpu.serving " + " ".join(sys.argv[1:]))
    doc: dict = {"environment": env, "results": [], "decode_sweep": []}
    out = args.out / f"serving_{torch.cuda.get_device_name().replace(' ', '_')}.json"
    for path in sorted(args.specs.glob("*.py")):
        if not (args.gen / f"gen_{path.stem}.py").is_file():
            continue
        try:
            prefill = "decode" not in path.stem
            doc["results"].append(check(path, args.gen, args.vllm_src, _designs(args.prefill_designs) if prefill else ()))
        except Exception as err:
            trace = traceback.format_exc()[-2000:]
            doc["results"].append({"spec": path.stem, "error": f"{type(err).__name__}: {err}", "trace": trace})
        torch.cuda.empty_cache()
        print(json.dumps(doc["results"][-1], default=str), flush=True)
        out.write_text(json.dumps(doc, indent=2, default=str))  # a run cut short keeps what it measured
    if args.sweep:
        for path in sorted(args.specs.glob("*decode*.py")):
            if (args.gen / f"gen_{path.stem}.py").is_file():
                try:
                    doc["decode_sweep"] += sweep(path, args.gen, env["copy_gbps"], args.vllm_src,
                                                 designs=_designs(args.designs))
                except Exception as err:
                    doc["decode_sweep"].append({"spec": path.stem, "error": f"{type(err).__name__}: {err}"})
                out.write_text(json.dumps(doc, indent=2, default=str))

if __name__ == "__main__":
    main()
