"""Cheat: a "scratch buffer" like split-KV partials, filled by a torch op with the [B, H, Sq, Skv, D] score products.

Allocating scratch is honest (split-KV kernels do); computing attention into it with torch ops is not."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        B, H, M, D = q.shape
        scratch = q.new_empty(B, H, M, k.shape[2], D)  # allocation only: allowed
        torch.mul(q.unsqueeze(-2), k.unsqueeze(-3), out=scratch)  # the score matrix materialised by torch: caught
        s = scratch.sum(-1) * D ** -0.5
        p = (s - s.amax(-1, keepdim=True)).exp()
        return (p / p.sum(-1, keepdim=True)).unsqueeze(-1).mul(v.unsqueeze(-3)).sum(-2)
