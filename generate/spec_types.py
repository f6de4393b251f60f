"""What a spec's loaders share: the dtypes a spec may name, its shapes, its state, the reference's type.

generate.spec builds a `Spec` from what its two loaders (generate.spec_kernelbench, generate.spec_flex) read off a
file; these are the pieces all three speak in, so that the loaders never import generate.spec back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "Reference", "Shapes", "StateTensor"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shapes:
    B: int
    Hq: int
    Hkv: int
    M: int  # seq_q
    N: int  # seq_kv
    D: int  # q and k's head dim
    dtype: str  # one of DTYPES
    Dv: int = 0  # v's (and the output's) head dim; 0 = D

    def __post_init__(self) -> None:
        if not self.Dv:
            object.__setattr__(self, "Dv", self.D)

    @property
    def value_dim(self) -> bool:
        """Does v have a head dim of its own (D_v != D_qk)?"""
        return self.Dv != self.D

    @property
    def gqa_ratio(self) -> int:
        return self.Hq // self.Hkv

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class StateTensor:
    """One entry of the spec Model's state_dict, as a candidate must hold it so that
    `ModelNew.load_state_dict(Model.state_dict())` works and a new value takes effect."""

    key: str  # the state_dict key, e.g. "attn.rel_bias"
    parameter: bool  # an nn.Parameter (else a buffer)
    aux: str | None  # the aux tensor the kernel reads it as (a 0-dim one as `aux[0]` of shape [1]); None: not read
    baked: bool = False  # a buffer the kernel holds as the index expression its value equals (tril/band masks)
