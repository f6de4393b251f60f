"""Cheat: silently computes an fp32 spec in fp16 and casts back."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        h = torch.float16
        s = torch.matmul(q.to(h), k.to(h).transpose(-2, -1)) * q.shape[-1] ** -0.5
        return torch.matmul(torch.softmax(s.float(), -1).to(h), v.to(h)).float()
