"""Output checks: identity (plain tensor, no aliasing), shape/dtype, and numerics.

Tolerance (see docs/verify.md): an element passes when
    |out - ref| <= atol * scale + rtol * |ref|,   scale = max(1, max|ref|)
with (atol, rtol) by the spec's dtype. Where the reference is NaN (e.g. a fully masked
row, whose value is undefined) any candidate value is accepted; everywhere else the
candidate must be finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TOLERANCES", "Comparison", "compare", "identity_problem", "storage_ptrs"]

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float64: (1e-6, 1e-6),
}


@dataclass(frozen=True)
class Comparison:
    ok: bool
    max_abs_err: float
    max_rel_err: float
    nonfinite: int  # candidate NaN/Inf where the reference is finite
    bad_elements: int
    first_bad: tuple[int, ...] | None


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Comparison:
    atol, rtol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    got = out.detach().float().cpu()
    want = ref.detach().float().cpu()
    defined = ~torch.isnan(want)
    scale = max(1.0, float(want[defined].abs().max())) if bool(defined.any()) else 1.0
    err = (got - want).abs()
    nonfinite = defined & ~torch.isfinite(got)
    bad = defined & (nonfinite | (err > atol * scale + rtol * want.abs()))
    err = torch.where(defined & ~nonfinite, err, torch.zeros_like(err))
    rel = err / (want.abs() + scale * 1e-3)
    first = tuple(int(i) for i in bad.nonzero()[0]) if bool(bad.any()) else None
    return Comparison(ok=not bool(bad.any()), max_abs_err=float(err.max()) if err.numel() else 0.0,
                      max_rel_err=float(rel.max()) if rel.numel() else 0.0, nonfinite=int(nonfinite.sum()),
                      bad_elements=int(bad.sum()), first_bad=first)


def storage_ptrs(values: list[Any]) -> set[int]:
    return {x.untyped_storage().data_ptr() for x in values if isinstance(x, torch.Tensor)}


def identity_problem(out: Any, input_ptrs: set[int], what: str = "the output") -> tuple[str, str] | None:
    """(hack name, message) when `what` (the forward's output, or a gradient) is not a plain tensor with its own storage."""
    source = "forward returned" if what == "the output" else f"{what} is"
    if not isinstance(out, torch.Tensor):
        return "not_a_tensor", f"{source} {type(out).__name__}, not a torch.Tensor"
    if type(out) is not torch.Tensor:
        return "tensor_subclass", f"{source} a {type(out).__name__} (tensor subclass / lazy tensor), not a plain torch.Tensor"
    if out.untyped_storage().data_ptr() in input_ptrs:
        others = "an input" if what == "the output" else "an input, the output or dO"
        return "aliases_input", f"{what} shares storage with {others} (a view or the tensor itself)"
    return None
