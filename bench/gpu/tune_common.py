"""What the forward and the backward GPU timers share (bench.gpu.tune, bench.gpu.tune_bwd).

The plan schema and output tolerance, loading the user's spec and candidate files, the spec's inputs at a bench
shape, the baselines (FlexAttention from the spec's `flex_mods`, SDPA where the spec says it applies), attended
(q, kv) pairs for FLOP counts, timing, the environment record and writing a results document whole. Both timers
import this module; the backward timer never imports the forward one (`python -m bench.gpu.tune --backward` hands
its arguments to bench.gpu.tune_bwd's `main`). Needs torch and triton, not the KB.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import datetime as dt
import functools
import importlib.util
import inspect
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from generate.tune_schema import PLAN_SCHEMA, bench_shapes
from kb.ir.design import Design, arch_of_capability
from verify.checks import compare
from verify.timing import time_fn

# Each bench process (a spawned warm-up worker imports this module afresh) keeps the design choices its modules'
# timings make in a directory of its own, removed at exit: a worker timing designs beside others on the same GPU
# must not hand its choice to the timed process, which chooses as a user's first process does.
os.environ["KB_DESIGN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kb-bench-designs-")
atexit.register(shutil.rmtree, os.environ["KB_DESIGN_CACHE_DIR"], True)

__all__ = ["PLAN_SCHEMA", "output_ok", "load_file", "bench_shapes", "check_run", "make_inputs", "load_candidate", "spec_mods",
           "flex_call", "sdpa_call", "attended_pairs", "time_call", "sync", "environment", "write_results",
           "warm_in_workers"]

_SEED = 1234


def output_ok(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """The verifier's bf16 rule (verify.checks.compare: |o - ref| <= 2e-2 * max(1, max|ref|) + 2e-2 * |ref|), the one a
    generated kernel passed; a bare 2e-2 bound on |o - ref| failed honest bf16 kernels where rows of few keys give
    outputs of magnitude 2-4 (one bf16 ulp is 1.6e-2 there)."""
    return out.shape == ref.shape and compare(out, ref, torch.bfloat16).ok


# ---- loading the files a user has ------------------------------------------------------------

def load_file(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def check_run(plan: dict, device: str, no_gpu: str) -> None:
    """Exit with a one-line reason unless `plan` is a tune plan and `device` can run it: a CUDA GPU (else `no_gpu`),
    or the CPU dry run under the Triton interpreter."""
    if plan.get("schema") != PLAN_SCHEMA:
        raise SystemExit(f"not a kernel-kb tune plan (schema {plan.get('schema')!r}, expected {PLAN_SCHEMA!r})")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(no_gpu)
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("the CPU dry run needs TRITON_INTERPRET=1, set before triton is first imported")


def make_inputs(spec: ModuleType, shape: dict, device: str) -> list:
    torch.manual_seed(_SEED)
    make = getattr(spec, "bench_inputs", None)
    if make is not None and shape:
        n_params = len(inspect.signature(make).parameters)
        return list(make(device) if n_params == 1 else make(device, shape))
    out = []
    for t in spec.get_inputs():  # the spec's own (small) shape, floating tensors in bf16
        t = t.to(device)
        out.append(t.to(torch.bfloat16) if t.is_floating_point() else t)
    return out


def _init_args(spec: ModuleType, shape: dict) -> list:
    if shape and hasattr(spec, "bench_init_inputs"):
        return list(spec.bench_init_inputs())
    return list(spec.get_init_inputs())


_CANDIDATES: dict[Path, ModuleType] = {}


def _candidate_module(path: str, tag: str) -> ModuleType:
    """The candidate file's module, imported once per process, its per-shape design choices cleared.
    Once: the first import registers the module's operator, and a later import's `kb_attention` runs that operator,
    i.e. the first module's functions and design tables, which are the ones a sweep must pin and read."""
    key = Path(path).resolve()
    cand = _CANDIDATES.get(key)
    if cand is None:
        cand = _CANDIDATES[key] = load_file(path, f"kb_tune_cand_{tag}")
    for choices in ("_PICKED", "_BWD_PICKED"):
        getattr(cand, choices, {}).clear()
    return cand


def picked_design(module: ModuleType, table: str = "_PICKED") -> str | None:
    """The design the module chose first in `table` (`_PICKED`: its forward's, `_BWD_PICKED`: its backward's; a bench
    entry's shape makes one choice), as design text; None where it chose none (the `.cu` ran)."""
    picked = getattr(module, table, None)
    return str(Design.from_tuple(next(iter(picked.values())))) if picked else None


@contextlib.contextmanager
def first_listed(module: ModuleType) -> Iterator[None]:
    """Inside, the candidate runs the first listed design that fits instead of the fastest listed one timed at its
    first call (KB_DESIGN_TIMING=0, the module's choices and launch plans made afresh): the `emitted-first-listed`
    ablation, what modules ran before they timed their designs. Its own choices, plans and the environment are
    restored after."""
    # the launch plans too: an eager call replays its plan's launches, design included, without choosing again
    # (run 30's forward rows labelled "(None)" timed the chosen design that way)
    saved = {n: dict(getattr(module, n)) for n in ("_PICKED", "_BWD_PICKED", "_PLANS") if hasattr(module, n)}
    env = os.environ.get("KB_DESIGN_TIMING")
    os.environ["KB_DESIGN_TIMING"] = "0"
    for n in saved:
        getattr(module, n).clear()
    try:
        yield
    finally:
        if env is None:
            os.environ.pop("KB_DESIGN_TIMING", None)
        else:
            os.environ["KB_DESIGN_TIMING"] = env
        for n, choices in saved.items():
            getattr(module, n).clear()
            getattr(module, n).update(choices)


def load_candidate(entry: dict, spec: ModuleType, shape: dict, device: str, tag: str):
    """(candidate module, ModelNew instance carrying the spec Model's parameters and buffers at this shape)."""
    cand = _candidate_module(entry["candidate"], tag)
    init = _init_args(spec, shape)
    model = spec.Model(*init).to(device)
    new = cand.ModelNew(*init).to(device)
    for name, t in list(model.named_buffers()) + list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        target = new.get_submodule(owner) if owner else new
        if hasattr(target, leaf):  # the spec's tensors at this shape, under the names the candidate uses
            if leaf in target._parameters:
                target._parameters[leaf] = torch.nn.Parameter(t.detach().clone(), requires_grad=False)
            else:
                target._buffers[leaf] = t.detach().clone()
    return cand, model, new


# ---- baselines ---------------------------------------------------------------------------------

def spec_mods(spec: ModuleType, inputs: list, model: torch.nn.Module) -> tuple[Callable | None, Callable | None] | None:
    """(score_mod, mask_mod) from the spec's `flex_mods` for these inputs (and the Model, where it asks for
    it), or None when the spec gives no `flex_mods`."""
    make = getattr(spec, "flex_mods", None)
    if make is None:
        return None
    kwargs = {"model": model} if "model" in inspect.signature(make).parameters else {}
    return make(*inputs, **kwargs)


def flex_call(spec: ModuleType, inputs: list, model: torch.nn.Module,
              backend: str | None = None) -> Callable[[], torch.Tensor] | None:
    """Compiled FlexAttention over the spec's `flex_mods` (block mask built here, once); `backend` is its
    `kernel_options["BACKEND"]` ("FLASH": the CuTe DSL kernels of flash-attn-4), default torch's choice."""
    mods = spec_mods(spec, inputs, model)
    if mods is None:
        return None
    import torch._dynamo  # noqa: PLC0415  a second to import, and it imports Triton (see environment)

    # one compile per (variant, shape): past dynamo's default limit flex_attention silently falls back
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.cache_size_limit = 256
    score_mod, mask_mod = mods
    q, k, v = inputs[:3]
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    compiled = _compiled_flex(flex_attention)
    scale = getattr(spec, "SCALE", None)
    gqa = q.shape[1] != k.shape[1]
    options = {"BACKEND": backend} if backend else None
    return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                            kernel_options=options)


@functools.lru_cache(maxsize=1)
def _compiled_flex(flex_attention):
    return torch.compile(flex_attention, dynamic=False)


def sdpa_call(spec: ModuleType, inputs: list) -> Callable[[], torch.Tensor] | None:
    kind = getattr(spec, "SDPA", None)
    if kind not in ("causal", "none"):
        return None
    q, k, v = inputs[:3]
    scale = getattr(spec, "SCALE", None)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=kind == "causal", scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])


def attended_pairs(spec: ModuleType, inputs: list, model: torch.nn.Module) -> int:
    """(q, kv) pairs the mask keeps, summed over the batch (mask_mod evaluated on the GPU, head 0)."""
    q, k = inputs[0], inputs[1]
    B, M, N = q.shape[0], q.shape[2], k.shape[2]
    mask_mod = (spec_mods(spec, inputs, model) or (None, None))[1]
    if mask_mod is None:
        return B * M * N
    dev, total = q.device, 0
    kv = torch.arange(N, device=dev).view(1, -1)
    h = torch.zeros((), dtype=torch.long, device=dev)
    for b in range(B):
        bt = torch.tensor(b, device=dev)
        for r0 in range(0, M, 1024):
            rows = torch.arange(r0, min(M, r0 + 1024), device=dev).view(-1, 1)
            total += int(torch.as_tensor(mask_mod(bt, h, rows, kv)).expand(rows.shape[0], N).sum())
    return total


# ---- timing ------------------------------------------------------------------------------------

SLOW_CALL_S = 0.25  # a call this slow is timed SLOW_TRIALS times after one warm-up call (see time_call)
SLOW_TRIALS = 3


def time_call(fn: Callable[[], Any], trials: int) -> tuple[float, float, int]:
    """(median ms, IQR ms, trials) of `fn` on the GPU: one call by the wall clock first, then 5 warm-up calls and
    `trials` timed ones; a call slower than SLOW_CALL_S (FlexAttention's learnable T5 table gradient: 1.4 s a step)
    gets no more warm-up and SLOW_TRIALS trials, so one such baseline does not spend a minute of a device call."""
    if not torch.cuda.is_available():  # the CPU dry run (tests): wall clock of the interpreter, not a measurement
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            walls.append((time.perf_counter() - t0) * 1e3)
        return sorted(walls)[1], max(walls) - min(walls), len(walls)
    t0 = time.perf_counter()
    fn()
    sync()
    slow = time.perf_counter() - t0 > SLOW_CALL_S
    t = time_fn(fn, warmup=0 if slow else 5, trials=min(trials, SLOW_TRIALS) if slow else trials,
                drain=False)  # GPU time per call, launch overhead hidden (do_bench)
    return t.median_ms, t.iqr_ms, t.trials


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- environment and results -------------------------------------------------------------------

def environment(command: str) -> dict:
    import triton  # noqa: PLC0415  Triton's mode is fixed at its first import: a run's, not this module's import

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = ""
    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "arch": arch_of_capability(torch.cuda.get_device_capability(0)),
            "sms": props.multi_processor_count, "driver": driver, "torch_version": torch.__version__,
            "triton_version": triton.__version__, "cuda": torch.version.cuda or "", "command": command,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "copy_gbps": _copy_bandwidth()}


def _copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), the ceiling decode kernels are held to."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), warmup=5, trials=20, drain=False).median_ms
    return round(2 * (1 << 30) / ms / 1e6, 1)


def write_results(path: Path, doc: dict) -> None:
    """Write the results whole: through a temporary file renamed over a regular file (a reader never sees half a
    document); straight into anything else that exists (/dev/null, a pipe), which a rename would replace."""
    text = json.dumps(doc, indent=1)
    if path.exists() and not path.is_file():
        path.write_text(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def warm_in_workers(work: Callable[[Any], str], tasks: list, workers: int, budget_s: float,
                    say: Callable[[str], None]) -> None:
    """`work(task)` for every task in spawned processes (each compiles its kernels once), for at most `budget_s`;
    what is not compiled by then compiles in the timed process, before its timed calls. A task's answer other than
    "ok" is said. The warm-ups already running finish first: the timed calls must have the GPU alone (run 20: a
    learnable table's warm-up, still running, made the first entry's training step 2.2x slower)."""
    if workers <= 1 or not tasks:
        return
    pool = cf.ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=multiprocessing.get_context("spawn"))
    done = 0
    try:
        for fut in cf.as_completed([pool.submit(work, t) for t in tasks], timeout=budget_s):
            done += 1
            if fut.result() != "ok":
                say(f"warm {done}/{len(tasks)}: {fut.result()}")
    except cf.TimeoutError:
        say(f"warm-up stopped after {budget_s:.0f} s with {done}/{len(tasks)} compiles done")
    finally:
        t0 = time.perf_counter()
        pool.shutdown(wait=True, cancel_futures=True)
        if time.perf_counter() - t0 > 1.0:
            say(f"waited {time.perf_counter() - t0:.0f} s for the warm-ups already running")
    say(f"warmed {done} of {len(tasks)} compiles with {workers} workers")
