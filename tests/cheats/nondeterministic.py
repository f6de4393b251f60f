"""Cheat: a result that changes from run to run (here tiny noise; in kernels, racy atomics)."""
import torch
import torch.nn as nn
from _torch_attention import attention


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        out = attention(q, k, v, self.causal)
        return out + torch.rand_like(out) * 1e-7
