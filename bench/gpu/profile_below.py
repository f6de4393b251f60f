"""Nsight Compute on the entries of a `bench.gpu.tune` results file whose emitted kernel is slower than its anchor.

    python3 -m bench.gpu.profile_below PLAN.json RESULTS.json OUT_DIR [--most 4] [--timeout 60]

The anchor is SDPA for decode shapes (M <= 16), else compiled FlexAttention. For each of the `--most`
slowest entries (emitted/anchor, lowest first) it profiles one launch of `emitted` and of the anchor with
`bench.gpu.profile` under `ncu --clock-control none` (speed of light, occupancy, launch statistics, warp
states, compute and memory workload), writing `ncu_<entry>_<impl>.txt` to OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from generate.tune_schema import impl_ms

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "ComputeWorkloadAnalysis",
            "MemoryWorkloadAnalysis")


def below(results: dict) -> list[tuple[float, str, str]]:
    """(emitted / anchor speed, entry name, anchor impl) for entries slower than their anchor, slowest first."""
    out = []
    for e in results["entries"]:
        for s in e.get("shapes", [])[:1]:
            anchor = "sdpa" if s.get("shape", {}).get("M", 0) <= 16 else "flex"
            em, an = impl_ms(s, "emitted"), impl_ms(s, anchor)
            if em and an and an / em < 1.0:
                out.append((an / em, e["name"], anchor))
    return sorted(out)


def main(plan: Path, results: Path, out_dir: Path, most: int, timeout: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for ratio, name, anchor in below(json.loads(results.read_text()))[:most]:
        for impl in ("emitted", anchor):
            cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off",
                   *(x for s in SECTIONS for x in ("--section", s)),
                   sys.executable, "-m", "bench.gpu.profile", str(plan), name, impl]
            path = out_dir / f"ncu_{name}_{impl}.txt"
            status: int | str  # the exit code, or "timeout"
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                path.write_text(done.stdout + done.stderr)
                status = done.returncode
            except subprocess.TimeoutExpired:
                status = "timeout"
            print(f"{name} ({ratio:.2f}x {anchor}) {impl}: ncu {status}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("results", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--most", type=int, default=4, help="profile at most this many entries")
    ap.add_argument("--timeout", type=int, default=60, help="seconds per ncu run")
    a = ap.parse_args()
    main(a.plan, a.results, a.out_dir, a.most, a.timeout)
