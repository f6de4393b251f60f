"""Typed rules for the JSON columns (`*_json`), for `kb.store.rules`.

Each checker takes the column's text and returns the problems found (empty: valid). What they accept is
what kernel-kb itself writes, so a row that passes can be read by generation and retrieval without a
type or range error:
- features (kernels, snippets, lessons): an object; the keys `kb.features.Features` knows have its
  field types (bools are bools, ints are ints within range, `mask` / `score_mod` one of their kinds);
  other keys are ignored, as `Features.from_json` ignores them.
- design (perf records): `{}` (nothing recorded), a `.cu` record `{"impl": "cuda", "lowering": str}`, or
  a `kb.ir.design.Design` as `to_dict` writes it (`Design.from_dict` is the rule).
- shape (perf records): an object; the dimension keys (`SHAPE_DIMS`) are positive ints, any other number
  finite and >= 0 (bench records add `flops`, `impl`, `schedule`).
- params (tunables): an object; the launch numbers (`LAUNCH_KEYS`) are ints in [1, 4096] or strings
  (a source may name a constant instead of a number).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any

from kb.errors import KBError
from kb.features import MASK_KINDS, SCORE_KINDS, Features

__all__ = ["SHAPE_DIMS", "LAUNCH_KEYS", "MAX_HEAD_DIM", "is_int", "features_problems", "design_problems",
           "shape_problems", "params_problems"]

SHAPE_DIMS = ("B", "H", "Hq", "Hkv", "M", "N", "S", "D", "Dv", "attended_pairs")
LAUNCH_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "num_threads")
MAX_HEAD_DIM = 1024
_MAX_DIM = 2**62  # attended_pairs = B * H * M * N can be large; anything that fits a signed 64-bit column
_FEATURE_RANGES = {"gqa_ratio": (1, 1 << 16), "head_dim": (0, MAX_HEAD_DIM), "kv_span": (0, 1 << 40)}
_FEATURE_CHOICES = {"mask": MASK_KINDS, "score_mod": SCORE_KINDS}
_FEATURE_TYPES = {f.name: type(f.default) for f in fields(Features)}


def is_int(v: object) -> bool:
    """An int that is not a bool (JSON `true` reads as an int in Python)."""
    return type(v) is int


def _object(text: str, what: str) -> tuple[dict[str, Any] | None, list[str]]:
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        return None, [f"{what} is not JSON"]
    if not isinstance(data, dict):
        return None, [f"{what} is a JSON {type(data).__name__}, not an object"]
    return data, []


def features_problems(text: str) -> list[str]:
    data, problems = _object(text, "features_json")
    if data is None:
        return problems
    for key, value in data.items():
        typ = _FEATURE_TYPES.get(key)
        if typ is None:
            continue
        ok = type(value) is typ
        if ok and key in _FEATURE_RANGES:
            lo, hi = _FEATURE_RANGES[key]
            ok = lo <= value <= hi
        if ok and key in _FEATURE_CHOICES:
            ok = value in _FEATURE_CHOICES[key]
        if not ok:
            allowed = (f"one of {list(_FEATURE_CHOICES[key])}" if key in _FEATURE_CHOICES else
                       f"an int in [{_FEATURE_RANGES[key][0]}, {_FEATURE_RANGES[key][1]}]" if key in _FEATURE_RANGES else
                       f"a {typ.__name__}")
            problems.append(f"{key} is {value!r}, not {allowed}")
    return problems


def design_problems(text: str) -> list[str]:
    data, problems = _object(text, "design_json")
    if data is None or not data:
        return problems
    if "impl" in data:  # the emitted .cu, timed beside the Triton module (generate.perf_import.cuda_impl)
        ok = data.get("impl") == "cuda" and set(data) == {"impl", "lowering"} and isinstance(data["lowering"], str)
        return [] if ok else [f"{data} is not a .cu record ({{\"impl\": \"cuda\", \"lowering\": NAME}})"]
    from kb.ir.design import Design  # noqa: PLC0415  the IR package loads only when a stored design is checked

    try:
        Design.from_dict(data)
    except KBError as err:
        return [str(err)]
    return []


def shape_problems(text: str) -> list[str]:
    data, problems = _object(text, "shape_json")
    if data is None:
        return problems
    for key, value in data.items():
        if key in SHAPE_DIMS and not (is_int(value) and 1 <= value <= _MAX_DIM):
            problems.append(f"{key} is {value!r}, not a positive int")
        elif key not in SHAPE_DIMS and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and not (math.isfinite(value) and 0 <= value <= 2.0**63):
            problems.append(f"{key} is {value!r}, not a finite number >= 0")
    return problems


def params_problems(text: str) -> list[str]:
    data, problems = _object(text, "params_json")
    if data is None:
        return problems
    for key in LAUNCH_KEYS:
        value = data.get(key)
        if value is not None and not isinstance(value, str) and not (is_int(value) and 1 <= value <= 4096):
            problems.append(f"{key} is {value!r}, not an int in [1, 4096] or a name")
    return problems
