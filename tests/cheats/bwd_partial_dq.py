"""Backward cheat: dq is only computed for the first 16 query rows; the rest of the buffer is left
as allocated (uninitialised memory: the harness poisons it with NaN)."""
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support" / "verify_fixtures"))
from triton_flash_bwd import flash_backward, flash_forward


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
        head = slice(0, 16)
        dq_head, dk, dv = flash_backward(q[:, :, head], k, v, o[:, :, head], lse[:, :, head].contiguous(), do[:, :, head],
                                         ctx.causal)
        dq = torch.empty_like(q)
        dq[:, :, head] = dq_head
        return dq, dk, dv, None


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return _Attention.apply(q, k, v, self.causal)

