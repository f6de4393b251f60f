"""One implementation of one plan entry, warmed up, then launched once inside a profiler range (not a benchmark).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats python3 -m bench.gpu.profile PLAN.json ENTRY IMPL

PLAN is a `kb tune --plan` file, ENTRY a plan entry's name (the spec's stem), IMPL `emitted` (ModelNew as a
user calls it), `flex`, `sdpa` or `design TEXT`; built by `bench.gpu.tune.entry_impls` exactly as
`kb tune` times them. Only the launch between cudaProfilerStart and Stop is profiled.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.gpu.tune import entry_impls


def main(plan: Path, entry_name: str, impl: str, shape: int, warmup: int) -> None:
    entries = {e["name"]: e for e in json.loads(plan.read_text())["entries"]}
    if entry_name not in entries:
        raise SystemExit(f"no entry {entry_name!r} in {plan}; one of {sorted(entries)}")
    impls = entry_impls(entries[entry_name], shape)
    if impl not in impls:
        raise SystemExit(f"no implementation {impl!r} for {entry_name}; one of {sorted(impls)}")
    with torch.no_grad():
        for _ in range(warmup):
            impls[impl]()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        impls[impl]()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("entry")
    ap.add_argument("impl")
    ap.add_argument("--shape", type=int, default=0, help="index into the entry's shapes")
    ap.add_argument("--warmup", type=int, default=3, help="calls before the profiled one")
    a = ap.parse_args()
    main(a.plan, a.entry, a.impl, a.shape, a.warmup)
