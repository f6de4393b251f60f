"""Learned relative-position bias (Shaw / T5 without buckets): a parameter table
bias[h, i - j + S - 1] added to the scores; bidirectional. q, k, v: [B, H, S, D] fp32."""
import math

import torch
import torch.nn as nn

B, H, S, D = 2, 4, 64, 64


class Model(nn.Module):
    def __init__(self, n_heads: int, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.rel_bias = nn.Parameter(torch.randn(n_heads, 2 * max_len - 1) * 0.5)

    def forward(self, q, k, v):
        n = q.shape[2]
        idx = torch.arange(n)[:, None] - torch.arange(n)[None, :] + self.max_len - 1   # [S, S]
        bias = self.rel_bias[:, idx]                                                   # [H, S, S]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias
        return scores.softmax(-1) @ v


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)]


def get_init_inputs():
    return [H, S]
