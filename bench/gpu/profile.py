"""One attention implementation launched a few times, for Nsight Compute (not a benchmark).

    ncu --clock-control none --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        PYTHONPATH=. python3 -m bench.gpu.profile causal 8192 128 generated

IMPL is any implementation name `kb bench` times for that case (`generated`, `sdpa-cudnn`,
`flex`, ...), built exactly as the bench builds it, on the bench's inputs for the case.
"""

from __future__ import annotations

import argparse

import torch


def main(variant: str, S: int, D: int, impl: str, launches: int) -> None:
    from bench.gpu.run import case_impls, case_tensors
    from bench.gpu.suite import suite_cases, torch_mods

    case = next(c for c in suite_cases("h200") if c.variant == variant and c.S == S and c.D == D)
    q, k, v, aux = case_tensors(case)
    mask, score = torch_mods(case, aux)
    impls = {name: fn for name, _, fn, _ in case_impls(case, q, k, v, aux, mask, score, tune=False, ablate=False)}
    if impl not in impls:
        raise SystemExit(f"no implementation {impl!r} for {case.label}; one of {sorted(impls)}")
    for _ in range(launches):
        impls[impl]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant")
    ap.add_argument("S", type=int)
    ap.add_argument("D", type=int)
    ap.add_argument("impl")
    ap.add_argument("--launches", type=int, default=5)
    a = ap.parse_args()
    main(a.variant, a.S, a.D, a.impl, a.launches)
