"""Does a module that dispatches to its `.cu` build and run it on a GPU, as users call it (measuring only).

    PYTHONPATH=. python3 -m bench.gpu.dispatch_check --gen DIR [--only a,b] [--out DIR]

For each spec S of --only whose `gen_S.kbir` and `gen_S.cu` `kb generate` wrote into --gen, the forward module is
lowered again with a dispatch that lists this GPU and the spec's head dim (an ABLATION: `kb generate` writes a dispatch
only where measured records say the `.cu` is faster), the `.cu` copied beside it. At the spec's BENCH shape, bf16,
no gradient: the `.cu` must be built at the first call and run (eager, `torch.compile(fullgraph=True)` and a
`torch.cuda.graph` replay), o must match the generated Triton module's forward, and both are timed
(`triton.testing.do_bench`, median). Writes `<out>/dispatch_<gpu>.json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import traceback
from pathlib import Path

import torch
import triton.testing

from kb.ir.design import head_bucket
from kb.ir.text import parse_program
from kb.lower.cuda_dispatch import CudaDispatch
from kb.lower.runtime import import_file
from kb.lower.triton import lower_program


def check(stem: str, gen: Path, specs: Path, out: Path) -> dict:
    bench = import_file(specs / f"{stem}.py", f"spec_{stem}").BENCH
    shape = {k: bench[k] for k in ("B", "Hq", "Hkv", "M", "N", "D")}
    arch = "sm%d%d" % torch.cuda.get_device_capability()
    program = parse_program((gen / f"gen_{stem}.kbir").read_text())
    cu_name = f"gen_{stem}.cu"
    shutil.copy(gen / cu_name, out / cu_name)
    dispatch = CudaDispatch(cu_name, (gen / cu_name).read_text(), "sm_90a",
                            {arch: {head_bucket(shape["D"]): "forced by bench.gpu.dispatch_check (ablation)"}})
    (out / f"gen_{stem}_dispatch.py").write_text(lower_program(program, cuda=dispatch))
    mod = import_file(out / f"gen_{stem}_dispatch.py", f"dispatch_{stem}")
    triton_mod = import_file(gen / f"gen_{stem}_triton.py", f"triton_{stem}")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(shape["B"], shape["Hq"], shape["M"], shape["D"], device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(shape["B"], shape["Hkv"], shape["N"], shape["D"], device="cuda", generator=g).to(torch.bfloat16)
            for _ in range(2))
    res: dict = {"spec": stem, "shape": shape, "arch": arch}
    with torch.no_grad():
        o = mod.kb_attention(q, k, v)
        torch.cuda.synchronize()
        res["cu_ran"] = any(lib is not None for lib in mod._CUDA_LIBS.values())
        ref = triton_mod.forward(q, k, v)[0]
        res["max_abs_vs_triton"] = (o.float() - ref.float()).abs().max().item()
        compiled = torch.compile(lambda a, b, c: mod.kb_attention(a, b, c), fullgraph=True)
        res["compiled_max_abs"] = (compiled(q, k, v).float() - o.float()).abs().max().item()
        graph = torch.cuda.CUDAGraph()
        mod.kb_attention(q, k, v)  # warm, outside the capture
        with torch.cuda.graph(graph):
            o_graph = mod.kb_attention(q, k, v)
        graph.replay()
        torch.cuda.synchronize()
        res["graphed_max_abs"] = (o_graph.float() - o.float()).abs().max().item()
        res["cu_ms"] = triton.testing.do_bench(lambda: mod.kb_attention(q, k, v), warmup=25, rep=200)
        res["triton_ms"] = triton.testing.do_bench(lambda: triton_mod.kb_attention(q, k, v), warmup=25, rep=200)
    res["cu_vs_triton"] = res["triton_ms"] / res["cu_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gen", type=Path, required=True, help="kb generate's --out directory")
    ap.add_argument("--specs", type=Path, default=Path("bench/heldout"))
    ap.add_argument("--only", default="causal_d128_bf16,gqa_causal,cross_bf16_d128")
    ap.add_argument("--out", type=Path, default=Path("out/dispatch"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for stem in args.only.split(","):
        try:
            results.append(check(stem, args.gen, args.specs, args.out))
        except Exception as err:
            results.append({"spec": stem, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]})
        print(json.dumps(results[-1], default=str)[:600], flush=True)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    (args.out / f"dispatch_{gpu}.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
