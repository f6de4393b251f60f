"""Backward cheat: bwd_autograd_recompute with every name hidden from the static scan (getattr), so
only the guard sees it: an autograd graph recorded inside the candidate's backward."""
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support" / "verify_fixtures"))
from triton_flash_bwd import flash_forward


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, _ = flash_forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        with getattr(torch, "enable_" + "grad")():
            x = [t.detach().requires_grad_() for t in (q, k, v)]
            s = (x[0].unsqueeze(-2) * x[1].unsqueeze(-3)).sum(-1) * q.shape[-1] ** -0.5
            if ctx.causal:
                s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
            p = (s - s.amax(-1, keepdim=True)).exp()
            o = ((p / p.sum(-1, keepdim=True)).unsqueeze(-1) * x[2].unsqueeze(-3)).sum(-2)
            dq, dk, dv = getattr(torch.autograd, "gr" + "ad")(o, x, do)
        return dq, dk, dv, None


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return _Attention.apply(q, k, v, self.causal)

