"""Chunked prefill against a KV cache: 64 new queries are the *last* 64 of 192 positions,
so the causal mask is aligned to the bottom right (query i sees keys j <= i + 128).
q: [B, H, 64, D], k, v: [B, H, 192, D] fp32."""
import math

import torch
import torch.nn as nn

B, H, SQ, SKV, D = 2, 4, 64, 192, 64


class Model(nn.Module):
    def forward(self, q, k, v):
        m, n = q.shape[2], k.shape[2]
        qpos = torch.arange(m) + (n - m)
        kpos = torch.arange(n)
        future = kpos[None, :] > qpos[:, None]
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(future, float("-inf"))
        return torch.matmul(s.softmax(dim=-1), v)


def get_inputs():
    return [torch.randn(B, H, SQ, D), torch.randn(B, H, SKV, D), torch.randn(B, H, SKV, D)]


def get_init_inputs():
    return []
