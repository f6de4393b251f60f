"""GPU timing with L2 flush, and the hardware-anchored score of DESIGN.md.

`time_fn` runs `warmup` untimed calls, then `trials` timed ones; before each trial it
writes a buffer of `flush_bytes` (larger than L2) so no trial reads warm cache, and each
trial is bracketed by CUDA events with the device synchronised before the end event is
read, so work left on side streams is counted. CPU-only machines are not timed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Timing", "time_fn", "attention_flops", "attention_bytes", "roofline_ms", "perf_term", "composite_score"]


@dataclass(frozen=True)
class Timing:
    median_ms: float
    iqr_ms: float
    min_ms: float
    max_ms: float
    trials: int


def time_fn(fn: Callable[[], Any], warmup: int = 10, trials: int = 50, flush_bytes: int = 256 << 20,
            drain: bool = True) -> Timing:
    """Median and IQR of `fn()` in ms on the current CUDA device.

    `drain=True` (the verifier) synchronizes the whole device inside each trial's window, so work a candidate
    hides on a side stream is counted; the window then also holds the host's launch latency. `drain=False`
    (benchmarks of known implementations) queues every trial's flush and call back to back and reads the
    events once at the end, as `triton.testing.do_bench` does: the GPU time of each call, with the host's
    launch overhead hidden behind the previous trial's flush, as in a model's steady state."""
    if not torch.cuda.is_available():
        raise RuntimeError("time_fn needs a CUDA device; CPU runs are reported as 'not timed'")
    flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(trials):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        if drain:
            torch.cuda.synchronize()  # drain every stream, so side-stream work is inside the window
        end.record()
        if drain:
            end.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return Timing(statistics.median(times), q[2] - q[0], min(times), max(times), len(times))


def attention_flops(B: int, H: int, Sq: int, Skv: int, D: int, unmasked_fraction: float = 1.0,
                    Dv: int | None = None) -> float:
    """Forward FLOPs: 2*Sq*Skv*D for q @ k^T plus 2*Sq*Skv*Dv for p @ v per (batch, head), times the
    unmasked share (Dv defaults to D)."""
    return 2.0 * B * H * Sq * Skv * (D + (D if Dv is None else Dv)) * unmasked_fraction


def attention_bytes(B: int, Hq: int, Hkv: int, Sq: int, Skv: int, D: int, elem_bytes: int, Dv: int | None = None) -> float:
    """Compulsory traffic: read q, k, v once and write o once (v and o Dv wide; Dv defaults to D)."""
    Dv = D if Dv is None else Dv
    return float(elem_bytes * (B * Hq * Sq * (D + Dv) + B * Hkv * Skv * (D + Dv)))


def roofline_ms(flops: float, nbytes: float, peak_tflops: float, peak_gbps: float) -> float:
    return max(flops / (peak_tflops * 1e12), nbytes / (peak_gbps * 1e9)) * 1e3


def perf_term(t_cand: float, t_base: float, t_limit: float) -> float:
    """(T_base - T_limit) / ((T_cand - T_limit) + (T_base - T_limit)): 0.5 at baseline speed, 1 at the limit."""
    t_limit = min(t_limit, t_cand, t_base)
    denom = (t_cand - t_limit) + (t_base - t_limit)
    return 1.0 if denom <= 0 else (t_base - t_limit) / denom


def composite_score(compiled: bool, correct: bool, perf: float | None) -> float:
    """CANN Bench's composite: compile 0.2, correctness 0.3, performance 0.5 (0 when not correct/timed)."""
    return 0.2 * compiled + 0.3 * correct + 0.5 * (perf if (correct and perf is not None) else 0.0)
