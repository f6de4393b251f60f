"""FlexAttention-style specs: module-level `score_mod` / `mask_mod` and `SHAPES` (docs/specs.md, style 2).

`trace_mods(module, mods, path)` traces the mods (generate.spec_trace.trace_mod) into variant expressions
and the aux tensors they load (named as the file or the mods' closures name them: a factory's
`document_id` keeps its name). A file that also has a KernelBench `Model` takes its variants from the mods
and its shapes, reference and call from the Model; one without takes them from `SHAPES` and a dense torch
evaluation of the mods (`FlexMods.shapes`, `FlexMods.reference`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from generate.spec_trace import tensor_namer, trace_mod
from generate.spec_types import Reference, Shapes
from kb.errors import KBError
from kb.ir.expr import Expr, print_expr
from kb.ir.nodes import MASK_MOD_PARAMS, SCORE_MOD_PARAMS
from verify.flex import dense_attention, parse_shapes
from verify.flex_mods import captured_tensors

__all__ = ["FlexMods", "trace_mods"]


@dataclass(frozen=True)
class FlexMods:
    """A spec's traced mods, with the functions themselves and `SHAPES` as the file defines it (None: absent)."""

    score_mod: Expr | None  # None also for the identity `score`
    mask_mod: Expr | None
    aux: dict[str, torch.Tensor]
    functions: Mapping[str, Callable[..., Any]]  # "score_mod" / "mask_mod" -> the user's function
    shapes_dict: Any

    def shapes(self, path: Path) -> Shapes:
        """The shapes `SHAPES` gives; KBError saying what is missing or wrong."""
        try:
            f = parse_shapes(self.shapes_dict)
        except ValueError as err:
            raise KBError(f"{path}: {err}") from None
        return Shapes(f.B, f.Hq, f.Hkv, f.M, f.N, f.D, f.dtype, f.Dv)

    def scale(self, shapes: Shapes) -> float:
        """`SHAPES["scale"]`, else 1/sqrt(D)."""
        s = self.shapes_dict.get("scale") if isinstance(self.shapes_dict, Mapping) else None
        return 1.0 / math.sqrt(shapes.D) if s is None else float(s)

    def reference(self, shapes: Shapes) -> Reference:
        """Plain torch attention evaluating the user's mods on broadcast index tensors (int32, as
        FlexAttention passes them); fully masked rows give 0. The same function `kb verify` runs
        as the Model of a FlexAttention-style spec (verify.flex)."""
        score_mod, mask_mod, scale = self.functions.get("score_mod"), self.functions.get("mask_mod"), self.scale(shapes)

        def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return dense_attention(q, k, v, score_mod, mask_mod, scale)

        return reference


def trace_mods(module: Any, mods: Mapping[str, Callable[..., Any]], path: Path) -> FlexMods:
    """Trace the spec module's `mods` (score_mod and/or mask_mod); KBError on anything unsupported."""
    name_of = tensor_namer(_module_tensors(module) + captured_tensors(list(mods.values())))
    src = str(path.resolve())
    aux: dict[str, torch.Tensor] = {}
    score = mask = None
    if "score_mod" in mods:
        score, a = trace_mod(mods["score_mod"], SCORE_MOD_PARAMS, name_of, src)
        aux.update(a)
        score = None if print_expr(score) == "score" else score
    if "mask_mod" in mods:
        mask, a = trace_mod(mods["mask_mod"], MASK_MOD_PARAMS, name_of, src, boolean=True)
        aux.update(a)
    return FlexMods(score, mask, aux, mods, getattr(module, "SHAPES", None))


def _module_tensors(module: Any) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor) and not k.startswith("__")]
