"""Ablation harness: IR programs re-lowered here, timed beside SDPA, FlexAttention and eager PyTorch on one GPU.

    PYTHONPATH=. python3 -m bench.gpu.run [SUITE] [--out DIR] [--deadline-s S] [--no-tune]

Not what users get: `kb bench` times the files `kb generate` emitted (bench.gpu.tune). This harness
re-lowers `bench/kernels/*.kbir` with the product's default designs (generate.designs, no KB) and with
lowering options switched off, to see what each part of the lowering is worth; its "generated*"
records are those ablations.

For each case of the suite (bench.gpu.suite), in one process: build the inputs (bf16, seeded),
count the attended (q, kv) pairs exactly, run every implementation once and compare its output
with the reference implementation (FlexAttention, else SDPA) before timing anything, then time
each with verify.timing.time_fn (warm-up, L2 flush before each trial, median) and measure its peak
memory. Results go to `<out>/bench_<suite>.json` (schema in docs/bench.md), rewritten after every
case so a run cut short keeps what it measured; a table is printed last. Imports only torch,
triton, numpy, matplotlib and the project's kb.ir / kb.lower / kb.errors / kb.settings / verify.timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench.gpu import baselines as bl
from bench.gpu.baselines import Unsupported
from bench.gpu.plot import plot_all
from bench.gpu.report import summary_table
from bench.gpu.suite import (VARIANTS, attended_pairs, attention_flops, aux_tensors, declared_aux, load_program, suite_cases,
                             torch_mods)
from generate.designs import default_designs
from kb.errors import KBError
from kb.ir.text import content_hash
from kb.lower.runtime import TritonKernel
from kb.lower.triton import LowerOptions
from verify.timing import time_fn

__all__ = ["main", "require_cuda", "Record", "SCHEMA"]

log = logging.getLogger("bench.gpu")
SCHEMA = "kernel-kb/bench/v1"


def require_cuda() -> None:
    """Raise the user-facing error of `kb bench` on a machine without a CUDA GPU."""
    if not torch.cuda.is_available():
        raise KBError("kb bench needs a CUDA GPU; none is visible to torch here "
                      "(run it on a GPU machine, then `record_results` the JSON into a KB)")


@dataclass(frozen=True)
class Record:
    """One implementation on one case (a row of the JSON `records`)."""

    case: str
    variant: str
    impl: str
    source: str  # where the implementation came from (kbir file, builder, torch API)
    shape: dict
    dtype: str
    status: str  # ok | unsupported | error | oom | mismatch
    ms: float | None = None
    iqr_ms: float | None = None
    tflops: float | None = None
    frac_peak: float | None = None
    peak_mem_bytes: int | None = None
    max_abs_err: float | None = None
    schedule: dict | None = None
    content_hash: str | None = None
    error: str = ""


def _env(command: str) -> dict:
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = ""
    import triton  # noqa: PLC0415  Triton's mode is fixed at its first import: a run's, not this module's import

    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "torch_version": torch.__version__,
            "triton_version": triton.__version__, "cuda": torch.version.cuda or "", "command": command,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def measure_peak_tflops() -> float:
    """bf16 dense matmul rate (8192^3, random data) on this GPU, TFLOP/s."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time_fn(lambda: a @ b, warmup=10, trials=30)
    return 2 * 8192 ** 3 / (t.median_ms * 1e-3) / 1e12


def _peak_mem(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def _out_tensor(res: object) -> torch.Tensor:
    if isinstance(res, dict):
        return res["o"]
    if isinstance(res, tuple):
        return res[0]
    return res  # type: ignore[return-value]


def case_impls(case, q, k, v, aux: dict, mask, score, tune: bool, ablate: bool) -> list[tuple[str, str, Callable, dict]]:
    """(impl, source, fn, extra) for every implementation of `case`; fn may raise Unsupported."""
    prog, source = load_program(case.variant)
    aux = declared_aux(prog, aux)
    inputs = {"q": q, "k": k, "v": v, **aux}
    out: list[tuple[str, str, Callable, dict]] = []

    def gen(p, opts: LowerOptions | None = None, **extra) -> Callable:
        """Program `p` lowered (with `opts`: an ablation, some speed options off), run on the case's inputs."""
        kern = TritonKernel.from_program(p, options=opts)
        return lambda: kern.run({**inputs, **extra})["o"]

    # An ablation: the program re-lowered here, launched with the product's first default design (this harness
    # has no KB); what `kb generate` emits, with the designs the KB chose, is timed by `kb bench` (bench.gpu.tune)
    grid = default_designs(decode=False)
    default = grid[0].apply(prog)
    sched = dataclasses.asdict(default.schedule)
    meta = {"schedule": sched, "content_hash": content_hash(default)}
    kern = TritonKernel.from_program(default)
    if hasattr(kern.module, "block_class_table"):
        # host-table variants: the table is built once, as FlexAttention's block mask is ("generated");
        # "generated+table" also builds it on every call
        table = kern.module.block_class_table(q, k, v, **aux)
        out.append(("generated", source, lambda: kern.run({**inputs, "block_class": table})["o"], meta))
        out.append(("generated+table", source, lambda: kern.run(inputs)["o"], meta))
        # the same kernel scanning every KV block with a per-block class branch (before indexed_kv_loop)
        out.append(("generated-noindex", source, gen(default, LowerOptions(indexed_kv_loop=False), block_class=table), meta))
    else:
        out.append(("generated", source, lambda: kern.run(inputs)["o"], meta))
    is_tune = tune and case.variant == "causal" and case.S in (1024, 8192)
    if is_tune:
        for d in grid[1:7]:
            p = d.apply(default)
            out.append((f"generated[{d}]", source, gen(p), {"schedule": dataclasses.asdict(p.schedule),
                                                           "content_hash": content_hash(p)}))
    if ablate and is_tune and case.S == 8192 or (ablate and case.variant == "plain" and case.S == 8192 and case.D == 128):
        for label, opts in (("generated-noopt", LowerOptions(False, False, False, False)),
                            ("generated-nosplit", LowerOptions(split_kv_loop=False)),
                            ("generated-nofold", LowerOptions(fold_scale=False)),
                            ("generated-noheavy", LowerOptions(heavy_first=False))):
            out.append((label, source, gen(default, opts), {"schedule": sched}))
    var = VARIANTS[case.variant]
    for be in ("cudnn", "flash"):
        if var.causal or case.variant == "plain":
            out.append((f"sdpa-{be}", "torch.nn.functional.scaled_dot_product_attention",
                        bl.sdpa_fn(be, case, q, k, v, None, causal=var.causal), {}))
    if not var.causal and case.variant != "plain":
        def masked(be: str) -> Callable:
            def run():
                attn = dense["mask"]
                return bl.sdpa_fn(be, case, q, k, v, attn, causal=False)()
            return run
        dense: dict = {}
        try:
            dense["mask"] = bl.dense_mask_bias(case, mask, score, q.device)
            for be in ("cudnn", "efficient", "math"):
                out.append((f"sdpa-{be}", "torch.nn.functional.scaled_dot_product_attention(attn_mask)", masked(be), {}))
        except bl.Unsupported as err:
            out.append(("sdpa", "torch.nn.functional.scaled_dot_product_attention", _raiser(err), {}))
    out.append(("flex", "torch.compile(flex_attention)", bl.flex_fn(case, q, k, v, mask, score), {}))
    out.append(("eager", "torch matmul+softmax (fp32 scores)", bl.eager_fn(case, q, k, v, mask, score), {}))
    return out


def _raiser(err: Exception) -> Callable:
    def run():
        raise err
    return run


def case_tensors(case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """bf16 q, k, v on the GPU (seeded by the case) and the case's aux tensors."""
    torch.manual_seed(hash(case) % (2 ** 31))
    q = torch.randn(case.B, case.Hq, case.S, case.D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(case.B, case.Hkv, case.S, case.D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(case.B, case.Hkv, case.S, case.D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, aux_tensors(case, "cuda")


def run_case(case, env: dict, peak: float, tune: bool, ablate: bool) -> list[Record]:
    q, k, v, aux = case_tensors(case)
    mask, score = torch_mods(case, aux)
    pairs = attended_pairs(case, mask, "cuda")
    flops = attention_flops(case, pairs)
    shape = {"B": case.B, "Hq": case.Hq, "Hkv": case.Hkv, "M": case.S, "N": case.S, "D": case.D,
             "attended_pairs": pairs, "flops": flops}
    base = dict(case=case.label, variant=case.variant, shape=shape, dtype="bf16")
    impls = case_impls(case, q, k, v, aux, mask, score, tune, ablate)
    outs: dict[str, torch.Tensor] = {}
    status: dict[str, tuple[str, str]] = {}
    for name, _, fn, _ in impls:  # correctness first: one run each, nothing timed yet
        try:
            outs[name] = _out_tensor(fn()).float()
            torch.cuda.synchronize()
            status[name] = ("ok", "")
        except Unsupported as err:
            status[name] = ("unsupported", str(err))
        except torch.OutOfMemoryError as err:
            status[name] = ("oom", str(err).splitlines()[0])
        except Exception as err:  # a failing implementation is a result, not a crash of the suite
            status[name] = ("error", f"{type(err).__name__}: {str(err)[:300]}")
            log.warning("%s %s: %s", case.label, name, status[name][1])
        torch.cuda.empty_cache()
    ref_name = "flex" if "flex" in outs else next((n for n in outs if n.startswith("sdpa")), None)
    ref = outs.get(ref_name) if ref_name else None
    records: list[Record] = []
    for name, source, fn, extra in impls:
        st, msg = status[name]
        rec = Record(impl=name, source=source, status=st, error=msg, schedule=extra.get("schedule"),
                     content_hash=extra.get("content_hash"), **base)
        if st == "ok":
            o = outs[name]
            mae = float((o - ref).abs().max()) if ref is not None else None
            rel = float((o - ref).norm() / ref.norm()) if ref is not None else 0.0
            if not torch.isfinite(o).all() or rel > 1e-2:  # bf16 lands between 1e-3 and 1e-2 (METHOD.md)
                rec = dataclasses.replace(rec, status="mismatch", max_abs_err=mae,
                                          error=f"relative error {rel:.2e}, max abs {mae} vs {ref_name}")
            else:
                heavy = name in ("eager",) or name.startswith("sdpa-math")
                try:
                    t = time_fn(fn, warmup=3 if heavy else 5, trials=10 if heavy else 25)
                    mem = _peak_mem(fn)
                    tf = flops / (t.median_ms * 1e-3) / 1e12
                    rec = dataclasses.replace(rec, ms=t.median_ms, iqr_ms=t.iqr_ms, tflops=tf, frac_peak=tf / peak,
                                              peak_mem_bytes=mem, max_abs_err=mae)
                except torch.OutOfMemoryError as e:
                    rec = dataclasses.replace(rec, status="oom", error=str(e).splitlines()[0])
        records.append(rec)
        torch.cuda.empty_cache()
    del outs
    torch.cuda.empty_cache()
    return records


def _write(path: Path, env: dict, peak: float, records: list[Record], suite: str) -> None:
    doc = {"schema": SCHEMA, "suite": suite, "env": env, "peak_bf16_tflops": peak,
           "flop_convention": "4 * B * Hq * D * attended (q, kv) pairs, counted exactly from the mask; masked work is not counted",
           "records": [{**env, **dataclasses.asdict(r)} for r in records]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def main(suite: str = "h200", out_dir: Path | str = "bench/results", *, tune: bool = True, ablate: bool = True,
         deadline_s: float | None = None, plots: bool = True, plots_dir: Path | str | None = None) -> Path:
    """Run `suite`, write `<out_dir>/bench_<suite>.json` (+ plots), print a table; returns the JSON path."""
    require_cuda()
    cases = suite_cases(suite)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_{suite}.json"
    env = _env(" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    peak = measure_peak_tflops()
    log.info("bf16 matmul peak: %.0f TFLOP/s on %s", peak, env["gpu"])
    start = time.monotonic()
    records: list[Record] = []
    for case in cases:
        if deadline_s is not None and time.monotonic() - start > deadline_s:
            log.warning("deadline reached: skipping %s", case.label)
            continue
        t0 = time.monotonic()
        records += run_case(case, env, peak, tune, ablate)
        _write(path, env, peak, records, suite)
        log.info("%s done in %.0f s", case.label, time.monotonic() - t0)
    if plots:
        try:
            pdir = Path(plots_dir or out)
            pdir.mkdir(parents=True, exist_ok=True)
            plot_all(path, pdir)
        except ImportError as err:
            log.warning("no plots: %s", err)
    print(summary_table(json.loads(path.read_text())))
    return path


def _cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.gpu.run", description=__doc__.splitlines()[0])
    ap.add_argument("suite", nargs="?", default="h200")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--deadline-s", type=float, default=None)
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--no-ablate", action="store_true")
    ap.add_argument("--plots-dir", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    try:
        main(args.suite, args.out, tune=not args.no_tune, ablate=not args.no_ablate, deadline_s=args.deadline_s,
             plots_dir=args.plots_dir)
    except KBError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
