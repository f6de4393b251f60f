"""Cheat: returns torch.empty with only half the rows written, hoping the allocator hands back
the buffer where the harness just computed the reference (a naive harness would then pass)."""
import torch
import torch.nn as nn
from _torch_attention import attention


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        out = torch.empty_like(q)
        half = max(1, q.shape[2] // 2)
        out[:, :, :half] = attention(q[:, :, :half], k, v, self.causal)
        return out
