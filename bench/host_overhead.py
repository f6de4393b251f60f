"""The Python a generated module runs on the host per call, without a GPU (not a test; measuring only).

    .venv/bin/python bench/host_overhead.py [MODULE.py] [--calls 5000]

Imports a generated Triton module (default: tests/golden/triton/decode_split_kv.py, the split-KV decode with GQA
packing), replaces its kernels by stand-ins (a JIT launch runs Triton's own argument binding and cache key, which need
no GPU, then does nothing; a compiled kernel's launch does nothing: the driver call and the GPU are left out) and makes
it believe it runs on an sm90 GPU, then times, in CPU time of this process (less sensitive to
other load on the machine than wall time), one call of: `forward` replaying its launch plan, `forward` with plans
off (every call binds, chooses, and launches through the JIT path), `kb_attention` without gradients (forward
directly) and the registered operator (through the dispatcher). Shapes: B=128, Hq=8, Hkv=1, M=1, N=64, D=128 bf16
on CPU tensors (only the host code runs). Prints one JSON object (microseconds per call).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import types
from pathlib import Path
from typing import Callable

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature

ROOT = Path(__file__).resolve().parents[1]


class _Compiled:
    """A compiled kernel whose launch does nothing."""

    def __getitem__(self, grid):
        return lambda *args: None


class _Kernel:
    """A JIT kernel whose launch runs the part of Triton's JIT dispatch that needs no GPU (the binder that specialises
    every argument, and the cache key; built for an sm90 target) and returns a compiled kernel that does nothing."""

    def __init__(self, fn) -> None:
        self.arg_names = fn.arg_names
        self.binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
        self.keys: dict = {}

    def __getitem__(self, grid):
        def launch(*args, **kw):
            _, specialization, options = self.binder(*args, **kw, debug=False, instrumentation_mode="")
            compute_cache_key(self.keys, specialization, options)
            return _Compiled()
        return launch


def stubbed(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("host_overhead_module", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    for name in dir(mod):
        if name.endswith("_kernel") and hasattr(getattr(mod, name), "arg_names"):
            setattr(mod, name, _Kernel(getattr(mod, name)))
    setattr(mod, "_interpreting", lambda t: False)
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    # a stand-in with the one field the module reads, not a real _CudaDeviceProperties
    setattr(torch.cuda, "get_device_properties", lambda d=None: types.SimpleNamespace(multi_processor_count=132))
    mod.DESIGNS.setdefault("sm90", {})[128] = [(16, 64, 0, 4, 3, True, True)]
    return mod


def cpu_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(200):
        fn()
    t0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module", nargs="?", type=Path, default=ROOT / "tests" / "golden" / "triton" / "decode_split_kv.py")
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    mod = stubbed(args.module)
    q = torch.randn(128, 8, 1, 128, dtype=torch.bfloat16)
    k, v = torch.randn(128, 1, 64, 128, dtype=torch.bfloat16), torch.randn(128, 1, 64, 128, dtype=torch.bfloat16)
    out = {"module": str(args.module), "calls": args.calls}
    out["forward_plan_us"] = cpu_us(lambda: mod.forward(q, k, v), args.calls)
    with torch.no_grad():
        out["kb_attention_no_grad_us"] = cpu_us(lambda: mod.kb_attention(q, k, v), args.calls)
        out["operator_us"] = cpu_us(lambda: mod._OP(q, k, v, None), args.calls)
    planned = mod._kb_planned
    setattr(mod, "_kb_planned", lambda key, inputs, run: run(None))  # record nothing, so every call takes the whole path
    mod._PLANS.clear()
    out["forward_no_plan_us"] = cpu_us(lambda: mod.forward(q, k, v), args.calls)
    setattr(mod, "_kb_planned", planned)
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}, indent=2))


if __name__ == "__main__":
    main()
