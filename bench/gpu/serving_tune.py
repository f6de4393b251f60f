"""Serving designs measured on a GPU, as `kb perf import` takes them (measuring only).

    PYTHONPATH=. python3 -m bench.gpu.serving_tune --gen DIR --specs bench/tuning_serving OUT.json

For each spec S of --specs with a `gen_S.py` that `kb generate` wrote into --gen, the Triton module's forward on the
arguments ModelNew passes it is timed (CUDA-graph replay, median ms) as emitted and with each design of a grid forced
(`forward(..., _design=d)`), its output checked against the emitted design's: a paged decode at batch 16 and 128 with
2K and 16K tokens per sequence (the spec's heads and page size), a packed or chunked prefill at its bench shape. Writes
a `kernel-kb/tune/v1` document (the kernel's IR from the `.kbir` beside the module, its features from the report), so
the sweeps become measured perf records of a paged or varlen kernel: what generation ranks a serving module's designs
from (generate.designs). Tune on tuning specs, never on bench/heldout_serving.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import ModuleType

import torch

from bench.gpu.serving import _decode_inputs, _ms, _timed
from bench.gpu.tune import module_call
from bench.gpu.tune_common import environment, write_results
from generate.tune_schema import SCHEMA
from kb.ir.design import parse_design
from kb.lower.runtime import import_file

DECODE_DESIGNS = tuple(f"16x{n} w{w} s{s} split-auto" for n, w, s in (
    (16, 4, 2), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 3)))
PREFILL_DESIGNS = ("64x64 w4 s1", "64x64 w4 s2", "64x64 w4 s3", "64x128 w4 s2", "128x32 w4 s3", "128x64 w4 s2",
                   "128x64 w8 s2", "128x64 w8 s3", "128x128 w8 s2", "128x128 w8 s3")
DECODE_POINTS = ((16, 2048), (16, 16384), (128, 2048), (128, 16384))


def _records(cand: ModuleType, new: torch.nn.Module, inputs: list, designs: tuple[str, ...]) -> list[dict]:
    """The emitted design's record, then one per forced design (an error row where it does not run or differs)."""
    args, kwargs, _, ran = module_call(cand, new, inputs)
    if ran != "triton":
        return [{"impl": "emitted", "status": "error", "error": f"ModelNew ran the {ran}, not the Triton module"}]
    own = cand.forward(*args, **kwargs)[0]
    out = [{"impl": "emitted", "status": "ok", "ms": _ms(_timed(lambda: cand.forward(*args, **kwargs)[0]))}]
    for text in designs:
        design = parse_design(text).as_tuple()

        def call(d: tuple = design) -> torch.Tensor:
            return cand.forward(*args, _design=d, **kwargs)[0]

        row: dict = {"impl": f"design {text}", "design": text}
        try:
            err = (call().float() - own.float()).abs().max().item()
            if not err <= 0.05:  # bf16 rounding of one tile order against another's
                raise ValueError(f"output differs from the emitted design's by {err:.3g}")
            row.update(status="ok", ms=_ms(_timed(call)), max_abs_vs_emitted=err)
        except Exception as exc:
            row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
        out.append(row)
        torch.cuda.empty_cache()
    return out


def _entry(path: Path, gen: Path) -> dict:
    spec = import_file(path, f"spec_{path.stem}")
    cand = import_file(gen / f"gen_{path.stem}.py", f"cand_{path.stem}")
    report = json.loads((gen / f"gen_{path.stem}.report.json").read_text())
    kernel = {"id": report["kernel_id"], "name": f"gen_{path.stem}", "family": "generated", "origin": "generated",
              "ir_text": (gen / f"gen_{path.stem}.kbir").read_text(), "features_json": report["features"],
              "dtype": "bf16", "verified": report["status"] == "verified"}
    new = cand.ModelNew(*spec.get_init_inputs()).cuda()
    entry: dict = {"name": path.stem, "spec": str(path), "kernel": kernel, "shapes": []}
    bench = spec.BENCH
    if "decode" in path.stem:
        points = [(_decode_inputs(bench, b, n), {"B": b, "Hq": bench["Hq"], "Hkv": bench["Hkv"], "M": 1, "N": n,
                                                 "D": bench["D"]}) for b, n in DECODE_POINTS]
        designs = DECODE_DESIGNS
    else:
        lens = bench.get("CONTEXT") or bench["SEQ_LENS"]
        points = [(spec.bench_inputs("cuda"), {"B": len(lens), "Hq": bench["Hq"], "Hkv": bench["Hkv"],
                                                "M": max(bench.get("CHUNKS") or lens), "N": max(lens), "D": bench["D"]})]
        designs = PREFILL_DESIGNS
    for inputs, shape in points:
        with torch.no_grad():
            records = _records(cand, new, inputs, designs)
        entry["shapes"].append({"shape": shape, "dtype": "bf16", "records": records,
                                "emitted_design": list(cand.PROGRAM_DESIGN)})
        print(path.stem, shape, [(r["impl"], round(r.get("ms", 0), 4)) for r in records], flush=True)
        del inputs
        torch.cuda.empty_cache()
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gen", type=Path, required=True, help="kb generate's --out directory for the tuning specs")
    ap.add_argument("--specs", type=Path, default=Path("bench/tuning_serving"))
    ap.add_argument("out", type=Path, help="the results document (kernel-kb/tune/v1)")
    args = ap.parse_args()
    if "heldout" in str(args.specs):
        ap.error("--specs: tune on tuning specs, not held-out ones")
    env = environment("python -m bench.gpu.serving_tune " + " ".join(sys.argv[1:]))
    doc: dict = {"schema": SCHEMA, "env": env, "entries": []}
    for path in sorted(args.specs.glob("*.py")):
        if (args.gen / f"gen_{path.stem}.py").is_file():
            try:
                doc["entries"].append(_entry(path, args.gen))
            except Exception as err:
                doc["entries"].append({"name": path.stem, "error": f"{type(err).__name__}: {err}"[:500]})
            write_results(args.out, doc)  # a run cut short keeps what it measured


if __name__ == "__main__":
    main()
