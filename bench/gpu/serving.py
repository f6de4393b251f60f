"""Generated serving kernels on a GPU, as users call them (measuring only).

    PYTHONPATH=. python3 -m bench.gpu.serving --gen DIR [--specs bench/heldout_serving] [--out DIR]

For each spec S of --specs with a `gen_S.py` that `kb generate` wrote into --gen: the spec's `bench_inputs("cuda")`
(its BENCH shape, the engine's layout), `Model(*bench_init_inputs())` and `ModelNew` with the Model's state loaded.
ModelNew's output is compared with the Model's (fp32 math on the same inputs), then timed eager and as a CUDA graph
replay (`triton.testing.do_bench`, median ms); the Model itself (torch: gathers the whole cache, then dense attention)
is timed beside it. For decode, bandwidth counts the K and V bytes of each sequence's keys once (what a decode kernel
must read), so GB/s against the GPU's HBM peak says how far the kernel is from the roofline; for packed and chunked
prefill, TFLOP/s of the full per-sequence products (a chunk's queries times its sequence's context). Writes `<out>/serving_<gpu>.json`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import traceback
from pathlib import Path

import torch
import triton.testing

from kb.lower.runtime import import_file


def check(path: Path, gen: Path) -> dict:
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
        graph = torch.cuda.CUDAGraph()
        new(*inputs)  # warm, outside the capture
        with torch.cuda.graph(graph):
            o_graph = new(*inputs)
        graph.replay()
        torch.cuda.synchronize()
        res["graphed_max_abs"] = (o_graph.float() - got.float()).abs().max().item()
        res["eager_ms"] = triton.testing.do_bench(lambda: new(*inputs), warmup=25, rep=200)
        res["graph_ms"] = triton.testing.do_bench(graph.replay, warmup=25, rep=200)
        if run_model:
            res["model_ms"] = triton.testing.do_bench(lambda: model(*inputs), warmup=5, rep=50)
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    if run_model:
        res["vs_model"] = res["model_ms"] / res["graph_ms"]
    if packed or chunked:  # FLOPs of the full per-sequence products, 4 * Hq * D * len_q * len_k (no causal halving)
        if chunked:
            lq, lk = named["query_start_loc"].long().diff(), named["seq_lens"].long()
        else:
            lq, lk = (x[1:] - x[:-1] for x in (inputs[3].long(), inputs[4].long()))
        res["tflops_per_s"] = 4 * q.shape[1] * d * int((lq * lk).sum()) / 1e12 / (res["graph_ms"] / 1e3)
        return res
    kv_bytes = 2 * int(lengths.long().sum()) * hkv * d * k_cache.element_size()
    res["kv_gbytes"] = kv_bytes / 1e9
    res["graph_gb_per_s"] = kv_bytes / 1e9 / (res["graph_ms"] / 1e3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gen", type=Path, required=True, help="kb generate's --out directory")
    ap.add_argument("--specs", type=Path, default=Path("bench/heldout_serving"))
    ap.add_argument("--out", type=Path, default=Path("out/serving"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for path in sorted(args.specs.glob("*.py")):
        if not (args.gen / f"gen_{path.stem}.py").is_file():
            continue
        try:
            results.append(check(path, args.gen))
        except Exception as err:  # noqa: BLE001 - one spec's failure is a result
            results.append({"spec": path.stem, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]})
        torch.cuda.empty_cache()
        print(json.dumps(results[-1], default=str)[:600], flush=True)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    (args.out / f"serving_{gpu}.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
