"""Peak memory of one call above the level before it.

CPU: Linux resets the process's peak RSS (VmHWM) on `echo 5 > /proc/self/clear_refs`,
so peak = VmHWM after - VmRSS before (tracemalloc cannot see torch's allocations).
Where that is not allowed, the RSS delta after the call is the fallback (a lower bound).
CUDA: torch.cuda's peak allocated bytes, reset before the call.
`poison_allocator` fills freed memory with NaN before a call, so a result read from
uninitialised memory is NaN, never a previous answer.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["PeakMemory", "measure_peak", "poison_allocator"]

_MIB = 1024 * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakMemory:
    mib: float = 0.0
    method: str = ""


@contextlib.contextmanager
def measure_peak(device: str) -> Iterator[PeakMemory]:
    result = PeakMemory()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        yield result
        torch.cuda.synchronize()
        result.mib, result.method = (torch.cuda.max_memory_allocated() - before) / _MIB, "cuda peak allocated"
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
        method = "peak RSS (VmHWM reset)"
    except OSError:
        method = "RSS delta (peak reset not permitted)"
    before = _status_kib("VmRSS")
    yield result
    after = _status_kib("VmHWM") if method.startswith("peak") else _status_kib("VmRSS")
    result.mib, result.method = max(0, after - before) / 1024, method


def poison_allocator(nbytes: int, device: str) -> None:
    """Allocate, NaN-fill and free buffers of the output's size so `torch.empty` hands back NaN."""
    for n in (nbytes, 2 * nbytes, nbytes + 4096):
        buf = torch.full((max(1, n // 4),), float("nan"), device=device)
        del buf
