"""Loading spec and candidate files (KernelBench convention) and checking they fit together.

A spec defines `Model(nn.Module)`, `get_inputs()`, `get_init_inputs()` and may define
`get_inputs_for(B, Hq, Hkv, Sq, Skv, D, dtype)`, `get_shapes()` / `SHAPES`, `CROSS`, `GQA`
and `CAUSAL`. A FlexAttention-style spec (module-level `score_mod` / `mask_mod` and a
`SHAPES` dict, no Model) gets those three from `verify.flex`: a dense-PyTorch Model of its
mods and inputs drawn at `SHAPES`; the dims its mods' data fixes (`document_id[q_idx]` over a
captured [S] tensor fixes M and N) are `Spec.fixed_dims`, which shape planning keeps. A candidate defines `ModelNew(nn.Module)` with the same constructor and
forward parameters. User mistakes in the spec or in the pairing raise `SpecError`; a
candidate that does not import raises `CandidateImportError` (a compile_error verdict).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping

from verify.flex import flex_entry_points, is_flex_module
from verify.flex_mods import data_bound_dims

__all__ = ["Spec", "SpecError", "CandidateImportError", "load_spec", "load_candidate", "check_signatures"]


class SpecError(Exception):
    """The spec or the spec/candidate pairing is wrong: a user mistake (KBError in the parent)."""


class CandidateImportError(Exception):
    """The candidate file does not import or lacks ModelNew; `detail` holds the traceback tail."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True)
class Spec:
    path: Path
    module: ModuleType
    model_cls: type
    get_inputs: Callable[[], list[Any]]
    get_init_inputs: Callable[[], list[Any]]
    get_inputs_for: Callable[..., list[Any]] | None
    shape_hints: tuple[tuple[int, ...], ...]
    cross: bool
    gqa: bool
    causal: bool
    # dims ("B", "Hq", "M", "N") the spec's data fixes -> why (FlexAttention specs whose mods read captured tensors;
    # verify.flex_mods.data_bound_dims): shape cases keep the spec's own value of each
    fixed_dims: Mapping[str, str] = field(default_factory=dict)


def _import_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_spec(path: Path) -> Spec:
    if not path.is_file():
        raise SpecError(f"spec file {path} does not exist")
    try:
        module = _import_file(path, "_kb_verify_spec")
    except Exception as err:
        raise SpecError(f"spec {path} does not import: {type(err).__name__}: {err}") from err
    if is_flex_module(module):
        return _flex_spec(path, module)
    missing = [n for n in ("Model", "get_inputs", "get_init_inputs") if not hasattr(module, n)]
    if missing:
        raise SpecError(f"spec {path} lacks {', '.join(missing)}; a spec defines Model(nn.Module), "
                        "get_inputs() and get_init_inputs() (KernelBench convention), or score_mod/mask_mod "
                        "and SHAPES (FlexAttention style)")
    hints = getattr(module, "get_shapes", None)
    raw_hints = hints() if callable(hints) else getattr(module, "SHAPES", ())
    if isinstance(raw_hints, dict):  # a FlexAttention-style SHAPES dict beside a Model: the spec's shape, not hints
        raw_hints = ()
    return Spec(
        path=path.resolve(), module=module, model_cls=module.Model,
        get_inputs=module.get_inputs, get_init_inputs=module.get_init_inputs,
        get_inputs_for=getattr(module, "get_inputs_for", None),
        shape_hints=tuple(_hint(h, path) for h in raw_hints),
        cross=bool(getattr(module, "CROSS", False)), gqa=bool(getattr(module, "GQA", False)),
        causal=bool(getattr(module, "CAUSAL", False)),
    )


def _flex_spec(path: Path, module: ModuleType) -> Spec:
    try:
        model_cls, get_inputs, get_init_inputs, shapes = flex_entry_points(module)
    except ValueError as err:
        raise SpecError(f"spec {path}: {err}") from None
    score_mod, mask_mod = (m if callable(m) else None for m in (getattr(module, n, None) for n in ("score_mod", "mask_mod")))
    fixed = data_bound_dims(score_mod, mask_mod,
                            {"B": shapes.B, "Hq": shapes.Hq, "M": shapes.M, "N": shapes.N})
    return Spec(
        path=path.resolve(), module=module, model_cls=model_cls, get_inputs=get_inputs,
        get_init_inputs=get_init_inputs, get_inputs_for=None, shape_hints=(),
        cross=shapes.M != shapes.N, gqa=shapes.Hq != shapes.Hkv, causal=bool(getattr(module, "CAUSAL", False)),
        fixed_dims=fixed,
    )


def _hint(hint: Any, path: Path) -> tuple[int, ...]:
    keys = ("B", "Hq", "Hkv", "Sq", "Skv", "D", "Dv")
    values = tuple(hint[k] for k in keys if k in hint) if isinstance(hint, dict) else tuple(hint)
    if len(values) not in (6, 7) or not all(isinstance(v, int) for v in values):
        raise SpecError(f"spec {path}: shape hint {hint!r} must be (B, Hq, Hkv, Sq, Skv, D[, Dv]) or a dict with those keys")
    return values


def load_candidate(path: Path) -> type:
    if not path.is_file():
        raise SpecError(f"candidate file {path} does not exist")
    try:
        module = _import_file(path, "_kb_verify_candidate")
    except BaseException as err:
        raise CandidateImportError(f"candidate does not import: {type(err).__name__}: {err}",
                                   traceback.format_exc(limit=-3)) from err
    if not hasattr(module, "ModelNew"):
        raise CandidateImportError("candidate defines no ModelNew(nn.Module)")
    return module.ModelNew


def _params(fn: Callable[..., Any]) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def check_signatures(model_cls: type, candidate_cls: type) -> None:
    """Constructor and forward parameter names must match exactly (order included)."""
    for what in ("__init__", "forward"):
        ref, cand = _params(getattr(model_cls, what)), _params(getattr(candidate_cls, what))
        if ref != cand:
            raise SpecError(f"ModelNew.{what}({', '.join(cand)}) does not match Model.{what}({', '.join(ref)}); "
                            "give ModelNew the same parameters as the spec's Model")
