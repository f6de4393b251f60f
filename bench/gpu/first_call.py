"""What the first call of a generated module costs a user: a fresh process, an empty Triton cache (not a test).

    python -m bench.gpu.first_call --from DIR SPEC [SPEC ...] [--out RESULTS.json]

For each spec (bench/heldout/<spec>.py), three child processes, each with its own empty TRITON_CACHE_DIR, import
DIR/gen_<spec>.py, build the spec's BENCH inputs (bf16) and time by the wall clock, synchronised: the first training
step (forward + backward of q, k, v), a second step, and the median of 5 more. The rows:
- `timed`: KB_DESIGN_TIMING=1, the module compiles and times its listed designs at its first call for a shape
  bucket, and keeps its choice in a fresh KB_DESIGN_CACHE_DIR;
- `kept`: the same directory in a later process, which runs the kept choice without timing (only it compiles);
- `first listed`: KB_DESIGN_TIMING=0, the first listed design that fits.
All run the same inputs and shapes, so the differences are the timing's cost at a first call and what keeping the
choice saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu.tune_common import (bench_shapes, environment, load_candidate, load_file, make_inputs, picked_design,
                                   write_results)

__all__ = ["child", "main"]


def _step(new: torch.nn.Module, inputs: list) -> float:
    """Wall ms of one training step: grads cleared, forward, backward of a fixed upstream gradient."""
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = new(*inputs)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def child(spec_path: str, candidate: str) -> dict:
    """This process's first, second and steady training steps of `candidate` at the spec's bench shape."""
    # tune_common gave this process a design directory of its own at import; the row's directory is the parent's
    os.environ["KB_DESIGN_CACHE_DIR"] = os.environ["KB_FIRST_CALL_DESIGNS"]
    spec = load_file(spec_path, "kb_first_spec")
    shape = bench_shapes(spec, None)[0]
    inputs = make_inputs(spec, shape, "cuda")
    for t in inputs[:3]:
        t.requires_grad_(True)
    cand, _, new = load_candidate({"candidate": candidate}, spec, shape, "cuda", "first")
    first = _step(new, inputs)
    second = _step(new, inputs)
    steady = statistics.median(_step(new, inputs) for _ in range(5))
    return {"first_ms": first, "second_ms": second, "steady_ms": steady, "forward_design": picked_design(cand),
            "backward_design": picked_design(cand, "_BWD_PICKED")}


def _run_child(spec: Path, candidate: Path, timing: str, designs: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, KB_DESIGN_TIMING=timing, KB_FIRST_CALL_DESIGNS=designs)
        proc = subprocess.run([sys.executable, "-m", "bench.gpu.first_call", "--child", str(spec), str(candidate)],
                              env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "CANDIDATE"), help=argparse.SUPPRESS)
    ap.add_argument("--from", dest="gen", type=Path, help="the --out directory of kb generate")
    ap.add_argument("--out", type=Path, default=None, help="where the results JSON goes")
    ap.add_argument("specs", nargs="*", help="spec names of bench/heldout (e.g. causal_d128_bf16)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    if args.gen is None or not args.specs:
        ap.error("give --from DIR and at least one spec name")
    doc: dict = {"environment": environment("python -m bench.gpu.first_call " + " ".join(sys.argv[1:])), "rows": []}
    for name in args.specs:
        spec, cand = Path("bench/heldout") / f"{name}.py", args.gen / f"gen_{name}.py"
        with tempfile.TemporaryDirectory() as designs:
            for run, timing in (("timed", "1"), ("kept", "1"), ("first listed", "0")):
                row = {"spec": name, "run": run, **_run_child(spec, cand, timing, designs)}
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
