"""Which shapes to test: the spec's own, its hints, then ragged, batch, cross and GQA variants.

The attention tensors are found in the spec's `get_inputs()`: the first three 4-D
floating tensors are q [B, Hq, Sq, D], k [B, Hkv, Skv, D] and v [B, Hkv, Skv, Dv] (Dv = D
unless the spec's value heads differ; every varied case keeps the spec's D and Dv). Sequence lengths are
varied only when every other input is shape-free (scalars, flags) or the spec provides
`get_inputs_for`; otherwise only the spec's own shape plus batch variation are used,
and a note says so. Seq_q differs from seq_kv only for `CROSS = True` specs or specs
whose own shapes differ; head counts change only for `GQA = True` specs or specs whose
own Hq != Hkv. A planned shape that the spec's Model rejects is dropped with a note. Dims a
FlexAttention spec's data fixes (`Spec.fixed_dims`) keep the spec's own value in every case, and a note
says which and why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from verify.load import Spec
from verify.result import ShapeCase

__all__ = ["Layout", "find_layout", "plan_cases", "held_summary", "RAGGED"]

RAGGED = (37, 1, 100, 129)  # none divisible by 16/32/64/128
CROSS_PAIRS = ((1, 129), (37, 100), (100, 37))


@dataclass(frozen=True)
class Layout:
    """Positions of q, k, v in the spec's input list (None: not an attention spec we understand)."""

    qkv: tuple[int, int, int] | None
    has_shaped_extras: bool  # tensors besides q/k/v whose shapes may depend on B or S


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def find_layout(inputs: list[Any]) -> Layout:
    idx = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point()]
    qkv = tuple(idx[:3]) if len(idx) >= 3 else None
    extras = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and (qkv is None or i not in qkv)]
    return Layout(qkv=qkv, has_shaped_extras=bool(extras))  # type: ignore[arg-type]


def own_case(inputs: list[Any], layout: Layout) -> ShapeCase | None:
    if layout.qkv is None:
        return None
    q, k, v = (inputs[i] for i in layout.qkv)
    B, Hq, Sq, D = q.shape
    return ShapeCase(B, Hq, k.shape[1], Sq, k.shape[2], D, dtype_name(q.dtype), "spec", v.shape[3])


def _hint_case(hint: tuple[int, ...], dtype: str) -> ShapeCase:
    """A SHAPE_HINTS entry (6 or 7 ints, as verify.load checks): B, Hq, Hkv, Sq, Skv, D and optionally Dv."""
    B, Hq, Hkv, Sq, Skv, D = hint[:6]
    return ShapeCase(B, Hq, Hkv, Sq, Skv, D, dtype, "hint", hint[6] if len(hint) > 6 else 0)


def plan_cases(spec: Spec, inputs: list[Any], max_cases: int) -> tuple[list[ShapeCase], list[str]]:
    """Shape cases to run, the spec's own first, and notes on what could not be varied."""
    layout = find_layout(inputs)
    own = own_case(inputs, layout)
    notes: list[str] = []
    if own is None:
        notes.append("no [B, H, S, D] q/k/v tensors found in get_inputs(): only the spec's own inputs are used")
        return [], notes
    cases = [own] + [_hint_case(h, own.dtype) for h in spec.shape_hints]
    can_vary = spec.get_inputs_for is not None or not layout.has_shaped_extras
    if can_vary:
        cases += _seq_variants(spec, own)
        if spec.gqa or own.Hq != own.Hkv:
            cases += [replace(own, Hkv=h, Sq=37, Skv=37, origin="gqa") for h in (1, own.Hq) if own.Hq % h == 0]
    else:
        notes.append("spec has extra tensor inputs and no get_inputs_for(B, Hq, Hkv, Sq, Skv, D, dtype): "
                     "only the spec's own shapes plus batch variation are used")
        cases += [replace(own, B=b, origin="batch") for b in (1, 2 * own.B) if b != own.B]
    if spec.fixed_dims:
        cases = [_hold(c, own, spec.fixed_dims) for c in cases]
        notes.append(_held_note(own, spec.fixed_dims))
    unique = list(dict.fromkeys(cases))
    dropped = len(unique) - max_cases
    if dropped > 0:
        notes.append(f"{dropped} planned shape cases left out (max_cases={max_cases})")
    return unique[:max_cases], notes


_CASE_FIELD = {"B": "B", "Hq": "Hq", "M": "Sq", "N": "Skv"}  # verify.flex_mods.DIMS -> ShapeCase fields


def _hold(case: ShapeCase, own: ShapeCase, fixed: Mapping[str, str]) -> ShapeCase:
    """`case` with every dim the spec's data fixes at the spec's own value."""
    return replace(case, **{_CASE_FIELD[d]: getattr(own, _CASE_FIELD[d]) for d in fixed})


def held_summary(fixed: Mapping[str, str]) -> str:
    """One line for a verdict's message: which dims were held at the spec's own values."""
    return f"{', '.join(_CASE_FIELD[d] for d in fixed)} held at the spec's own (fixed by the data its mods read)"


def _held_note(own: ShapeCase, fixed: Mapping[str, str]) -> str:
    held = ", ".join(f"{_CASE_FIELD[d]}={getattr(own, _CASE_FIELD[d])}" for d in fixed)
    why = "; ".join(f"{_CASE_FIELD[d]} + 1: {reason}" for d, reason in fixed.items())
    both = "M" in fixed and "N" in fixed
    return (f"held at the spec's own {held}: the mods read captured data of that extent ({why})"
            + ("; no sequence lengths but the spec's own are tried (ragged, cross)" if both else ""))


def _seq_variants(spec: Spec, own: ShapeCase) -> list[ShapeCase]:
    b = min(own.B, 2)
    cross = spec.cross or own.Sq != own.Skv
    out = [replace(own, B=b, Sq=37, Skv=37, origin="ragged"), replace(own, B=own.B + 1, origin="batch")]
    out += [replace(own, B=b, Sq=s, Skv=s, origin="ragged") for s in RAGGED[1:]]
    if cross:
        out += [replace(own, B=b, Sq=sq, Skv=skv, origin="cross") for sq, skv in CROSS_PAIRS]
    return out
