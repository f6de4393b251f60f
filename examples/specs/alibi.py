"""ALiBi attention (Press et al.): per-head linear distance penalty plus a causal mask.

Slopes are the geometric sequence 2^(-8 i / H); the bias for query i and key j is
slope[h] * (j - i) (<= 0 on the causal side). q, k, v: [B, H, S, D] fp32.
"""
import math

import torch
import torch.nn as nn

B, H, S, D = 2, 8, 96, 64


def alibi_slopes(n_heads: int) -> torch.Tensor:
    start = 2.0 ** (-8.0 / n_heads)
    return torch.tensor([start ** (i + 1) for i in range(n_heads)])


class Model(nn.Module):
    def __init__(self, n_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads))

    def forward(self, q, k, v):
        seq = q.shape[-2]
        pos = torch.arange(seq, device=q.device)
        rel = pos[None, :] - pos[:, None]                      # [S, S]: j - i
        bias = self.slopes[:, None, None] * rel[None]          # [H, S, S]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores + bias.unsqueeze(0)
        causal = torch.full((seq, seq), float("-inf"), device=q.device).triu(1)
        scores = scores + causal
        return torch.matmul(torch.softmax(scores, dim=-1), v)


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)]


def get_init_inputs():
    return [H]
