"""Gradient references and the gradient tolerance of `backward=True` runs.

Per checked call (see verify.session): a cotangent dO ~ N(0, 1) drawn from the call's seed (so
every call has its own); the **reference** gradients: the spec's Model one precision above the spec's
dtype (fp32 for bf16/fp16 specs, fp64 for fp32 specs) on the candidate's inputs upcast, TF32 off,
differentiated with respect to q, k, v and Model's learnable parameters (`requires_grad`
nn.Parameters, e.g. a relative-bias table); and **torch's own gradients in the spec's dtype**: the
spec's Model as the user runs it, on the same inputs and dO.
The candidate (ModelNew, holding Model's state_dict under the same keys) is differentiated with
respect to its same-named parameters.

Tolerance rule. Gradients accumulate over a whole sequence (dk, dv sum over every query row, a
bias table's gradient over every diagonal) and pass through differences of large numbers
(dS = P (dP - Δ)), so low-precision rounding costs more than in the forward. How much rounding is
fair is measured, not picked: `e_torch` is the largest distance from the reference of **torch
eager in the spec's dtype**, emulated on the reference itself: the fp32 reference computation with
every floating tensor an op produces (forward and backward) rounded to the spec's dtype
(`DtypeEmulation`), SDPA decomposed into its math ops. That is what eager PyTorch computes with
bf16 tensors (each op accumulates in fp32, stores in bf16), whatever fused op the spec happens to
call, so the basis does not depend on how the spec was written. For fp32 specs torch eager in the
spec's dtype is the fp32 Model itself and the reference is the Model computed in fp64 (`Float64`: a
float64 copy of the Model on float64 inputs, every op widened, so a spec's own `.float()` or fp32
constants compute in fp64 too). An fp32 gradient that sums many products over a large common offset
(a learnable temperature's: dS times the scores, over every pair of every head) is as far from the
true gradient as rounding makes it, and fp32 eager torch's distance is the measure of that; checked
against an fp32 reference with e_torch = 0, an exact kernel failed the 1e-4 table where the fp32
reference itself was 2e-4 away. The candidate may carry
`GRAD_SLACK` times that on top of the forward's dtype table. Element i of gradient g passes when

    |g_i - ref_i| <= atol * scale + rtol * |ref_i| + GRAD_SLACK * e_torch,
    scale = max(1, max|ref|)  (the forward's convention: q, k, v and dO are O(1), so 1 is their unit),

(atol, rtol) from `verify.checks.TOLERANCES` by the spec's dtype. GRAD_SLACK = 3 is the convention
of FlashAttention's gradient tests (flash-attn 2.8.3 tests/test_flash_attn.py::test_flash_attn_output:
dq, dk, dv within 3x eager PyTorch's error, the output within 2x): an FA-style backward takes
Δ = rowsum(dO∘O) from the stored low-precision output, eager torch rowsum(dP∘P), and where dP - Δ
cancels (the adversarial distribution) that difference alone costs about 2x. For fp32 specs e_torch is
fp32's own rounding (~1e-7 of the scale for dq, dk, dv), so the forward's table dominates: the
floor of 1 in `scale` matters there, because a gradient can be tiny and ill-conditioned (the
adversarial distribution's dq, a sum of near-cancelling terms, is ~1e-5 with a FlashAttention-style
Δ = rowsum(dO∘O) carrying absolute fp32 errors of ~1e-5 too).
The emulation rounds as the device's kernels do: to nearest on a GPU; toward zero for bf16 under
TRITON_INTERPRET=1, because Triton 3.6's interpreter converts fp32 -> bf16 by truncation (twice the
GPU's rounding error: an honest bf16 kernel there is up to ~3.5x as far from fp32 as round-to-nearest
eager torch, and within 2x of truncating eager torch).
torch's own gradient of a leaf comes in the leaf's dtype, so e_torch is measured after rounding torch's
gradients to it: a spec that computes and returns fp32 from bf16 inputs gets bf16 dq, dk, dv from torch
too, and against fp32's table alone no kernel could pass (the held-out fp32-out cross attention had no
backward before this).
Where the reference gradient is NaN (fully masked rows of a spec whose softmax gives NaN) any value
is accepted; elsewhere the candidate's gradient must be finite.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_map

from verify.checks import TOLERANCES, Comparison
from verify.dispatch_mode import WatchMode
from verify.reference import tf32
from verify.shapes import Layout

__all__ = ["GRAD_SLACK", "GradTargets", "grad_targets", "cotangent", "model_grads", "DtypeEmulation", "Float64",
           "torch_error", "grad_scale", "compare_grad", "rounded"]

GRAD_SLACK = 3.0


@dataclass(frozen=True)
class GradTargets:
    """What is differentiated: input positions (q, k, v) and Model's learnable parameter names."""

    positions: tuple[int, ...]
    names: tuple[str, ...]  # "q", "k", "v" (or "input 3" for a spec without a q/k/v layout)
    params: tuple[str, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        return self.names + tuple(f"param {p}" for p in self.params)


def grad_targets(layout: Layout, inputs: list[Any], model: nn.Module) -> GradTargets:
    """q, k, v (every floating tensor input when no q/k/v layout was found) and Model's trainable parameters."""
    names: tuple[str, ...]
    if layout.qkv is not None:
        positions, names = tuple(layout.qkv), ("q", "k", "v")
    else:
        positions = tuple(i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.is_floating_point())
        names = tuple(f"input {i}" for i in positions)
    params = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    return GradTargets(positions, names, params)


def cotangent(shape: torch.Size, seed: int, device: str) -> torch.Tensor:
    """dO ~ N(0, 1) in fp32 from its own generator: a fresh cotangent per call, reproducible from the seed."""
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    return torch.randn(tuple(shape), generator=gen).to(device)


def rounded(t: torch.Tensor, dtype: torch.dtype, truncate: bool = False) -> torch.Tensor:
    """`t` with the values it would have stored in `dtype`, in its own dtype; truncate: fp32 -> bf16 toward zero (as
    Triton's interpreter converts)."""
    if truncate and dtype == torch.bfloat16 and t.dtype == torch.float32:  # the top 16 bits: sign, exponent, 7 mantissa
        return (t.contiguous().view(torch.int32) & -65536).view(torch.float32).reshape(t.shape)
    return t.to(dtype).to(t.dtype)


class DtypeEmulation(WatchMode):
    """Round every fp32 tensor an op produces to `dtype` (and back), as if torch stored it in `dtype`.

    Views keep their base's values (not rounded, aliasing kept); in-place and `out=` ops are rounded in place.
    truncate: round bf16 toward zero (as Triton's interpreter converts fp32 -> bf16) instead of to nearest."""

    def __init__(self, dtype: torch.dtype, truncate: bool = False) -> None:
        super().__init__()
        self.dtype, self.truncate = dtype, truncate and dtype == torch.bfloat16

    def _round(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            return t
        return rounded(t, self.dtype, self.truncate)

    def dispatch(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        if func._schema.is_mutable:
            tree_map(lambda t: t.copy_(self._round(t)) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t, out)
            return out
        return tree_map(self._round, out)


class Float64(WatchMode):
    """Compute every op in fp64: fp32 operands, dtype arguments and results are widened (a spec's own `.float()`,
    an fp32 constant it builds). With a float64 copy of the Model and float64 inputs, autograd sees fp64 only."""

    @staticmethod
    def _widen(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
            return t.double()
        return torch.float64 if t is torch.float32 else t

    def dispatch(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable:  # in place into a tensor that exists: its dtype stays
            return func(*args, **(kwargs or {}))
        return tree_map(self._widen, func(*tree_map(self._widen, args), **tree_map(self._widen, kwargs or {})))


@contextlib.contextmanager
def _emulating(dtype: torch.dtype | None, truncate: bool) -> Iterator[None]:
    if dtype is None or dtype == torch.float32:
        yield
        return
    mode = Float64() if dtype == torch.float64 else DtypeEmulation(dtype, truncate)
    with sdpa_kernel(SDPBackend.MATH), mode:
        yield


def model_grads(model: nn.Module, inputs: list[Any], targets: GradTargets, d_out: torch.Tensor,
                emulate: torch.dtype | None = None, truncate: bool = False) -> list[torch.Tensor | None]:
    """Gradients of `model(*inputs)` (inputs upcast, TF32 off; `model` in fp32) for `targets`, cotangent `d_out`; fp32
    (fp64 for the fp64 reference).

    emulate: a low-precision dtype to run the computation in by `DtypeEmulation` (torch eager in that
    dtype), torch.float64 for the fp64 reference (a float64 copy of `model`, `Float64`), None for fp32.
    Inputs are detached copies: the caller's tensors are untouched."""
    wide = emulate == torch.float64
    if wide:
        model = copy.deepcopy(model).double()
    up = torch.float64 if wide else torch.float32
    leaves = [x.detach().clone().to(up) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
    wrt = [leaves[i].requires_grad_(True) for i in targets.positions]
    named = dict(model.named_parameters())
    wrt += [named[n] for n in targets.params]
    with tf32(False), torch.enable_grad(), _emulating(emulate, truncate):
        out = model(*leaves)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"spec Model returned {type(out).__name__}; verify compares one output tensor")
        grads = torch.autograd.grad(out, wrt, d_out.to(out.dtype), allow_unused=True)
    return [None if g is None else g.detach().to(up) for g in grads]


def torch_error(lowp: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """max |lowp - ref| over the elements where both are finite (0 when either is missing)."""
    if lowp is None or ref is None:
        return 0.0
    ok = torch.isfinite(lowp) & torch.isfinite(ref)
    return float((lowp - ref).abs()[ok].max()) if bool(ok.any()) else 0.0


def grad_scale(ref: torch.Tensor) -> float:
    """max(1, max |ref| over the defined elements)."""
    defined = ref[~torch.isnan(ref)]
    return max(1.0, float(defined.abs().max())) if defined.numel() else 1.0


def compare_grad(got: torch.Tensor, ref: torch.Tensor, e_torch: float, dtype: torch.dtype) -> Comparison:
    """The module's tolerance rule; errors in the result are normalised by the gradient's scale."""
    atol, rtol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    got, want = got.detach().float().cpu(), ref.detach().float().cpu()
    defined = ~torch.isnan(want)
    scale = grad_scale(want)
    err = (got - want).abs()
    nonfinite = defined & ~torch.isfinite(got)
    bad = defined & (nonfinite | (err > atol * scale + rtol * want.abs() + GRAD_SLACK * e_torch))
    err = torch.where(defined & ~nonfinite, err, torch.zeros_like(err))
    rel = err / (want.abs() + scale * 1e-3)
    first = tuple(int(i) for i in bad.nonzero()[0]) if bool(bad.any()) else None
    return Comparison(ok=not bool(bad.any()), max_abs_err=float(err.max()) / scale if err.numel() else 0.0,
                      max_rel_err=float(rel.max()) if rel.numel() else 0.0, nonfinite=int(nonfinite.sum()),
                      bad_elements=int(bad.sum()), first_bad=first)
