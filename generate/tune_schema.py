"""What `kb tune`'s plan half (generate.tune), `kb perf import` (generate.perf_import) and the GPU timers
(bench.gpu.tune, bench.gpu.tune_bwd) share without torch: the documents' schemas and a spec's bench shapes."""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = ["PLAN_SCHEMA", "SCHEMA", "SCHEMA_BACKWARD", "bench_shapes", "impl_ms"]

PLAN_SCHEMA = "kernel-kb/tune-plan/v1"  # the work: specs, candidates, kernels, shapes, designs
SCHEMA = "kernel-kb/tune/v1"  # forward results: ms per design beside FlexAttention and SDPA
SCHEMA_BACKWARD = "kernel-kb/tune-backward/v1"  # training steps per backward design


def bench_shapes(spec: ModuleType, given: Any = None) -> list[dict]:
    """The shapes to time a spec at: `given` (a plan entry's), else its `BENCH` (one dict or a list), else
    `[{}]`, meaning the spec's own `get_inputs()` shape. A shape may carry `Dv`, v's head dim when it differs
    from D (default D); the spec's `bench_inputs` reads it."""
    given = given or getattr(spec, "BENCH", None)
    if given is None:
        return [{}]
    return [dict(x) for x in given] if isinstance(given, (list, tuple)) else [dict(given)]


def impl_ms(shape: dict, impl: str) -> float | None:
    """The median ms of `impl` in one shape of a results document, when it ran correctly."""
    rec = next((r for r in shape.get("records", []) if r["impl"] == impl and r.get("status") == "ok"), None)
    return rec["ms"] if rec else None
