"""Input tensors for one (shape case, distribution, seed): always fresh storage.

Distributions (applied to q, k, v; other inputs come from the spec unchanged):
- normal: N(0, 1).
- uniform: U(-1, 1).
- large: q, k x 5.5 (logit std ~30, so exp() overflows without the running-max trick), v x 30.
- adversarial: q, k near-constant (1 + 1e-3 noise) so all logits tie, plus one key per
  (batch, kv-head) scaled x20 giving one huge logit per row; v near-constant per column.
Values are drawn in fp32 from a seeded generator, then cast to the spec's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from verify.load import Spec
from verify.result import ShapeCase
from verify.shapes import Layout

__all__ = ["make_inputs", "fill_distribution", "DISTRIBUTIONS"]

DISTRIBUTIONS = ("normal", "uniform", "large", "adversarial")


def _draw(shape: tuple[int, ...], dist: str, role: str, gen: torch.Generator) -> torch.Tensor:
    if dist == "normal":
        return torch.randn(shape, generator=gen)
    if dist == "uniform":
        return torch.rand(shape, generator=gen) * 2 - 1
    if dist == "large":
        return torch.randn(shape, generator=gen) * (30.0 if role == "v" else 5.5)
    if dist == "adversarial":
        if role == "v":
            base = torch.randn(shape[:2] + (1, shape[3]), generator=gen)
            return base + 1e-2 * torch.randn(shape, generator=gen)
        x = 1.0 + 1e-3 * torch.randn(shape, generator=gen)
        if role == "k":
            spike = torch.randint(0, shape[2], (shape[0], shape[1]), generator=gen)
            x[torch.arange(shape[0])[:, None], torch.arange(shape[1])[None, :], spike] *= 20.0
        return x
    raise ValueError(f"unknown distribution {dist!r}; known: {DISTRIBUTIONS}")


def fill_distribution(inputs: list[Any], layout: Layout, dist: str, gen: torch.Generator) -> list[Any]:
    """A new list where q, k, v are replaced by fresh tensors of `dist` (same shape/dtype/device)."""
    out = list(inputs)
    if layout.qkv is None:
        return [_draw(tuple(x.shape), dist, "q", gen).to(x.dtype).to(x.device)
                if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in out]
    for pos, role in zip(layout.qkv, ("q", "k", "v")):
        x = inputs[pos]
        out[pos] = _draw(tuple(x.shape), dist, role, gen).to(dtype=x.dtype, device=x.device)
    return out


def make_inputs(spec: Spec, layout: Layout, case: ShapeCase | None, dist: str, seed: int, device: str,
                base: list[Any] | None = None) -> list[Any]:
    """Fresh inputs for `case` (None: the spec's own inputs, or `base` when given) with q/k/v drawn from `dist`."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    base = list(base) if base is not None else _base_inputs(spec, layout, case)
    base = [x.to(device) if isinstance(x, torch.Tensor) else x for x in base]
    return fill_distribution(base, layout, dist, gen)


def _base_inputs(spec: Spec, layout: Layout, case: ShapeCase | None) -> list[Any]:
    if case is None or case.origin == "spec":
        return list(spec.get_inputs())
    dtype = getattr(torch, case.dtype)
    if spec.get_inputs_for is not None:
        return list(spec.get_inputs_for(case.B, case.Hq, case.Hkv, case.Sq, case.Skv, case.D, dtype))
    own = list(spec.get_inputs())
    if layout.has_shaped_extras:  # batch variation only: slice or stack whole spec inputs along dim 0
        return _rebatch(own, case.B, spec)
    assert layout.qkv is not None
    q, k, v = layout.qkv
    own[q] = torch.empty(case.B, case.Hq, case.Sq, case.D, dtype=dtype)
    own[k] = torch.empty(case.B, case.Hkv, case.Skv, case.D, dtype=dtype)
    own[v] = torch.empty(case.B, case.Hkv, case.Skv, case.Dv, dtype=dtype)
    return own


def _rebatch(own: list[Any], batch: int, spec: Spec) -> list[Any]:
    B = next(x.shape[0] for x in own if isinstance(x, torch.Tensor) and x.dim() == 4)
    if batch <= B:
        return [x[:batch].clone() if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == B else x for x in own]
    more = list(spec.get_inputs())
    return [torch.cat([a, b])[:batch] if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == B else a
            for a, b in zip(own, more)]
