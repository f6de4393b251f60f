"""Causal self-attention, bf16, small enough that the interpreter times a backward design in seconds
(tests/test_generate_tune_backward.py: `kb tune --backward` without a GPU)."""
import math

import torch
import torch.nn as nn

B, H, S, D = 1, 2, 64, 32
SDPA = "causal"


class Model(nn.Module):
    def forward(self, q, k, v):
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return (s.softmax(-1) @ v.float()).to(q.dtype)


def get_inputs():
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(3)]


def get_init_inputs():
    return []


def flex_mods(*inputs):
    return None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
