"""Are a generated backward's gradients bitwise reproducible, and what does `--deterministic` cost (measuring only).

    PYTHONPATH=. python3 -m bench.gpu.determinism --gen DIR [--det DIR] [--only a,b] [--specs bench/heldout] [--out DIR]

For each spec `S.py`, `gen_S.py` of --gen (as `kb generate` wrote it) and, with --det, of --det (as
`kb generate --deterministic` wrote it): at the spec's BENCH shape on the GPU, one training step of ModelNew
(forward, then backward of a fixed dO into q, k, v and the Model's parameters) run `--runs` times on the same inputs;
`bitwise_equal` says whether every gradient of every run equals the first run's bit for bit, `max_abs_diff` how far
they drift otherwise; `step_ms` is the step's median time (`triton.testing.do_bench`, L2 flushed). The report's
`backward.deterministic` beside it says what the generator claimed. Writes `<out>/determinism_<gpu>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.gpu.ops import _env, _models, load  # before triton: sets TRITON_INTERPRET for a CPU run
from triton.testing import do_bench

DEFAULT_SPECS = ("causal_d128_bf16", "gqa_causal", "relative_bias_learned")


def _grads(new: torch.nn.Module, ins: list[torch.Tensor], dout: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in ins]
    for p in new.parameters():
        p.grad = None
    new(*leaves).backward(dout)
    grads = [t.grad for t in leaves if t.is_floating_point()] + [p.grad for p in new.parameters()]
    assert all(g is not None for g in grads), "backward gave a float input or a parameter no gradient"
    return [g.clone() for g in grads if g is not None]


def measure(spec_path: Path, gen: Path, runs: int) -> dict:
    stem = spec_path.stem
    spec = load(spec_path, f"det_spec_{stem}")
    cand = load(gen / f"gen_{stem}.py", f"det_{gen.name}_{stem}")
    report = json.loads((gen / f"gen_{stem}.report.json").read_text())["backward"]
    if cand.NO_BACKWARD is not None:
        return {"spec": stem, "from": str(gen), "backward": report.get("status"), "reason": report.get("reason", "")}
    _, new, ins = _models(spec, cand, True)
    torch.manual_seed(1)
    dout = torch.randn_like(new(*ins))
    first = _grads(new, ins, dout)
    diffs = [max(float((g.float() - f.float()).abs().max()) for g, f in zip(_grads(new, ins, dout), first))
             for _ in range(runs - 1)]
    step = float(do_bench(lambda: _grads(new, ins, dout), warmup=25, rep=200, return_mode="median"))
    return {"spec": stem, "from": str(gen), "reported_deterministic": report.get("deterministic"),
            "nondeterministic_because": report.get("nondeterministic_because"), "runs": runs,
            "bitwise_equal": all(d == 0.0 for d in diffs), "max_abs_diff": max(diffs, default=0.0), "step_ms": step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen", type=Path, required=True, help="the --out DIR of `kb generate`")
    ap.add_argument("--det", type=Path, help="the --out DIR of `kb generate --deterministic` for the same specs")
    ap.add_argument("--specs", type=Path, default=Path("bench/heldout"))
    ap.add_argument("--only", default=",".join(DEFAULT_SPECS))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = ap.parse_args()
    result: dict = {"schema": "kernel-kb/determinism/v1", "env": _env(), "rows": []}
    result["env"]["command"] = result["env"]["command"].replace("bench.gpu.ops", "bench.gpu.determinism")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "determinism_gpu.json"
    for stem in args.only.split(","):
        for gen in (g for g in (args.gen, args.det) if g is not None):
            try:
                row = measure(args.specs / f"{stem}.py", gen, args.runs)
            except Exception as err:
                row = {"spec": stem, "from": str(gen), "error": f"{type(err).__name__}: {err}"}
            result["rows"].append(row)
            path.write_text(json.dumps(result, indent=2, default=str))
            print(json.dumps(row, default=str), flush=True)


if __name__ == "__main__":
    main()
