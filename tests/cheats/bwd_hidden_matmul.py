"""Backward cheat: honest Triton forward; the backward computes dq, dk, dv with torch matmul/softmax
reached through getattr (no forbidden name in the source; caught by the guard inside backward)."""
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support" / "verify_fixtures"))
from triton_flash_bwd import flash_forward

_MM = getattr(torch, "mat" + "mul")
_SM = getattr(torch, "soft" + "max")


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, _ = flash_forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, o)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        s = _MM(q, k.transpose(-2, -1)) * scale
        if ctx.causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        p = _SM(s, -1)
        dv = _MM(p.transpose(-2, -1), do)
        ds = p * (_MM(do, v.transpose(-2, -1)) - (do * o).sum(-1, keepdim=True))
        return _MM(ds, k) * scale, _MM(ds.transpose(-2, -1), q) * scale, dv, None


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return _Attention.apply(q, k, v, self.causal)

