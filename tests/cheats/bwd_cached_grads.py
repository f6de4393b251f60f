"""Backward cheat: honest kernels, but gradients are computed once per shape and replayed afterwards."""
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support" / "verify_fixtures"))
from triton_flash_bwd import flash_backward, flash_forward

_CACHE: dict = {}


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, lse = flash_forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        key = (tuple(q.shape), tuple(k.shape))
        if key not in _CACHE:
            _CACHE[key] = flash_backward(q, k, v, o, lse, do, ctx.causal)
        dq, dk, dv = (g.clone() for g in _CACHE[key])
        return dq, dk, dv, None


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return _Attention.apply(q, k, v, self.causal)

