"""Cheat: matmul emulated by broadcasting multiply + sum, softmax by exp/sum (no matmul/softmax op named)."""
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        s = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * q.shape[-1] ** -0.5  # [B, H, Sq, Skv, D] materialised
        p = (s - s.amax(-1, keepdim=True)).exp()
        p = p / p.sum(-1, keepdim=True)
        return (p.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)
