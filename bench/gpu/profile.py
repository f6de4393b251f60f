"""One attention implementation launched a few times, for Nsight Compute (not a benchmark).

    ncu --clock-control none --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        PYTHONPATH=. python3 -m bench.gpu.profile causal 8192 128 generated

IMPL is `generated` (the bench's kernel at this GPU's schedule), `sdpa-cudnn` or `flex`. The case
is the bench suite's B/H for that length; inputs bf16, as `kb bench` runs them.
"""

from __future__ import annotations

import argparse

import torch


def main(variant: str, S: int, D: int, impl: str, launches: int) -> None:
    from bench.gpu import baselines as bl
    from bench.gpu.suite import aux_tensors, declared_aux, load_program, schedule_for, suite_cases, torch_mods, with_schedule
    from kb.lower.runtime import TritonKernel

    case = next(c for c in suite_cases("h200") if c.variant == variant and c.S == S and c.D == D)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(case.B, case.Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(case.B, case.Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(case.B, case.Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    aux = aux_tensors(case, "cuda")
    if impl == "generated":
        prog, _ = load_program(variant)
        kern = TritonKernel.from_program(with_schedule(prog, schedule_for(D)))
        inputs = {"q": q, "k": k, "v": v, **declared_aux(prog, aux)}
        if hasattr(kern.module, "block_class_table"):
            inputs["block_class"] = kern.module.block_class_table(q, k, v, **declared_aux(prog, aux))
        fn = lambda: kern.run(inputs)["o"]  # noqa: E731
    elif impl == "sdpa-cudnn":
        fn = bl.sdpa_fn("cudnn", case, q, k, v, None, causal=True)
    else:
        mask, score = torch_mods(case, aux)
        fn = bl.flex_fn(case, q, k, v, mask, score)
    for _ in range(launches):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant")
    ap.add_argument("S", type=int)
    ap.add_argument("D", type=int)
    ap.add_argument("impl", choices=("generated", "sdpa-cudnn", "flex"))
    ap.add_argument("--launches", type=int, default=5)
    a = ap.parse_args()
    main(a.variant, a.S, a.D, a.impl, a.launches)
