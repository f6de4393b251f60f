"""Causal sliding-window (local) attention, Mistral style: each query sees itself and
the previous WINDOW - 1 keys. q, k, v: [B, H, S, D] fp32."""
import math

import torch
import torch.nn as nn

B, H, S, D, WINDOW = 2, 4, 128, 64, 32


class Model(nn.Module):
    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def forward(self, q, k, v):
        n = q.size(-2)
        pos = torch.arange(n)
        dist = pos.view(-1, 1) - pos.view(1, -1)             # i - j
        allowed = (dist >= 0) & (dist < self.window)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)]


def get_init_inputs():
    return [WINDOW]
