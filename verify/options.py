"""Options of one verification run (what to try, how long, which mode)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["VerifyOptions", "ALL_DISTRIBUTIONS"]

ALL_DISTRIBUTIONS = ("normal", "uniform", "large", "adversarial")


@dataclass(frozen=True)
class VerifyOptions:
    """Defaults are the full check; tests narrow `distributions` and `max_cases` for speed.

    seed None draws a fresh seed per run (recorded in the result). torch_baseline allows
    torch compute ops (matmul/softmax/SDPA) in the candidate; every other check still runs.
    backward also checks the gradients of q, k, v and of Model's learnable parameters on every
    call (verify.grads), with the forward's anti-cheat rules active inside the backward.
    """

    torch_baseline: bool = False
    backward: bool = False
    distributions: tuple[str, ...] = ALL_DISTRIBUTIONS
    max_cases: int = 8  # shape cases, the spec's own shape first
    seed: int | None = None
    determinism: bool = True
    timeout_s: float = 600.0  # the child's whole life; the CLI passes --timeout or KB_VERIFY_TIMEOUT
    memory_limit_mib: int = 16384  # RLIMIT_AS of the child on CPU (torch alone maps ~2-4 GiB)
    device: str = "auto"  # auto | cpu | cuda
    warmup: int = 10
    trials: int = 50
    flush_bytes: int = 256 << 20  # larger than any L2 (H200: 60 MiB)
    peak_tflops: float = 989.0  # dense bf16 of an H200 SXM; a bench run passes the measured one
    peak_gbps: float = 4800.0
    # a serving spec's layout by forward argument name (kind, k, v, table, lengths, table_k, q_offsets): the
    # session adds calls with pages moved and shared, ragged and empty sequences (verify.serving_cases)
    serving: dict[str, str | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VerifyOptions":
        kw = dict(data)
        kw["distributions"] = tuple(kw.get("distributions", ALL_DISTRIBUTIONS))
        return cls(**kw)
