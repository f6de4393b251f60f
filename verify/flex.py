"""The KernelBench entry points of a FlexAttention-style spec: a dense-PyTorch `Model` built from
its module-level `score_mod` / `mask_mod`, and `get_inputs()` / `get_init_inputs()` from `SHAPES`.

The reference follows FlexAttention's semantics (docs/specs.md):
    scores = q @ k^T * scale                     # fp32; scale None = 1/sqrt(D)
    scores = score_mod(scores, b, h, q_idx, kv_idx)  # vmapped over 0-dim int32 indices (verify.flex_mods)
    scores[~mask_mod(b, h, q_idx, kv_idx)] = -inf
    out = softmax(scores) @ v                    # kv heads repeated (GQA: head h reads h // (Hq // Hkv)); [B, Hq, M, Dv]
Rows with no visible key give 0. The output has q's dtype, as FlexAttention returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from verify.flex_mods import evaluate_mods, move_captured

__all__ = ["FlexShapes", "DTYPES", "dtype_name", "parse_shapes", "dense_attention", "flex_entry_points", "is_flex_module"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Mod = Callable[..., Any]


@dataclass(frozen=True)
class FlexShapes:
    B: int
    Hq: int
    Hkv: int
    M: int  # seq_q
    N: int  # seq_kv
    D: int
    dtype: str  # one of DTYPES
    scale: float | None  # None = 1/sqrt(D)
    Dv: int = 0  # v's (and the output's) head dim; 0 = D

    def __post_init__(self) -> None:
        if not self.Dv:
            object.__setattr__(self, "Dv", self.D)


_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"} | {
    str(t): name for name, t in DTYPES.items()}  # "torch.bfloat16" -> "bf16"


def dtype_name(dtype: Any) -> str:
    """The name in DTYPES of a `SHAPES` dtype: a torch dtype (torch.bfloat16) or its name ("bf16", "bfloat16");
    ValueError naming the accepted ones."""
    name = str(dtype)
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"SHAPES dtype {dtype!r} is not one of {', '.join(DTYPES)} "
                         "(or torch.float32, torch.bfloat16, torch.float16)")
    return name


def parse_shapes(d: Any) -> FlexShapes:
    """`SHAPES` of a FlexAttention-style spec; ValueError saying what is missing or wrong."""
    if not isinstance(d, Mapping):
        raise ValueError("a FlexAttention-style spec needs SHAPES = dict(B=, Hq=, Hkv=, M=, N=, D=, dtype=) (Dv= optional)")
    dtype = dtype_name(d.get("dtype", "fp32"))
    try:
        Hq, M = int(d.get("Hq", d.get("H"))), int(d.get("M", d.get("S")))
        scale = d.get("scale")
        D = int(d["D"])
        return FlexShapes(int(d["B"]), Hq, int(d.get("Hkv", Hq)), M, int(d.get("N", M)), D, dtype,
                          None if scale is None else float(scale), int(d.get("Dv", D)))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"SHAPES needs B, Hq (or H), M (or S), D and optionally Hkv, N, Dv, dtype, scale ({err})") from None


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Mod | None, mask_mod: Mod | None,
                    scale: float | None) -> torch.Tensor:
    """FlexAttention computed densely in fp32 (see module docstring); returns q's dtype."""
    B, Hq, M, D = q.shape
    rep = Hq // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    s = (q.float() @ kk.transpose(-2, -1)) * (1.0 / math.sqrt(D) if scale is None else scale)
    s, keep = evaluate_mods(s, score_mod, mask_mod)
    p = torch.softmax(s.masked_fill(~keep, -math.inf), dim=-1)
    p = torch.where(keep.any(-1, keepdim=True), p, torch.zeros((), dtype=p.dtype, device=q.device))
    return (p @ vv).to(q.dtype)


def is_flex_module(module: Any) -> bool:
    """True when the module defines score_mod and/or mask_mod but no Model."""
    return not hasattr(module, "Model") and any(callable(getattr(module, n, None)) for n in ("score_mod", "mask_mod"))


def flex_entry_points(module: Any) -> tuple[type, Callable[[], list[Any]], Callable[[], list[Any]], FlexShapes]:
    """(Model, get_inputs, get_init_inputs, shapes) for a FlexAttention-style spec module; ValueError on bad SHAPES."""
    shapes = parse_shapes(getattr(module, "SHAPES", None))
    score_mod, mask_mod = getattr(module, "score_mod", None), getattr(module, "mask_mod", None)
    score_mod = score_mod if callable(score_mod) else None
    mask_mod = mask_mod if callable(mask_mod) else None

    class Model(nn.Module):
        """Dense FlexAttention reference of the spec's mods (verify.flex)."""

        def __init__(self) -> None:
            super().__init__()

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            _globals_to(module, q.device)
            move_captured([m for m in (score_mod, mask_mod) if m is not None], q.device)
            return dense_attention(q, k, v, score_mod, mask_mod, shapes.scale)

    def get_inputs() -> list[Any]:
        s, dt = shapes, DTYPES[shapes.dtype]
        return [torch.randn(s.B, s.Hq, s.M, s.D).to(dt), torch.randn(s.B, s.Hkv, s.N, s.D).to(dt),
                torch.randn(s.B, s.Hkv, s.N, s.Dv).to(dt)]

    def get_init_inputs() -> list[Any]:
        return []

    return Model, get_inputs, get_init_inputs, shapes


def _globals_to(module: Any, device: torch.device) -> None:
    """Move the module-level tensors the mods read (SLOPES, DOC_IDS, ...) to `device`: the mods look
    their globals up at call time, so on a GPU they index device tensors with device indices."""
    for name, t in list(vars(module).items()):
        if isinstance(t, torch.Tensor) and not name.startswith("__") and t.device != device:
            setattr(module, name, t.to(device))
