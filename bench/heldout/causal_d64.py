"""Causal self-attention, head dim 64 (GPT-2 style), fp32.

Variant: causal (top-left), no GQA, default scale 1/sqrt(64).
Small shape (CPU check): B=2, H=4, S=200, D=64; inputs fp32, output fp32.
Bench shape (H200, bf16): B=8, H=16, S=4096, D=64.
"""
import math

import torch
from torch import nn

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 200, 64

BENCH = dict(B=8, Hq=16, Hkv=16, M=4096, N=4096, D=64)
SDPA = "causal"


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, query, key, value):
        seq = query.size(-2)
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(query.size(-1))
        future = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=query.device), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return torch.matmul(weights, value)


def get_inputs():
    shape = (BATCH, HEADS, SEQ, HEAD_DIM)
    return [torch.randn(shape), torch.randn(shape), torch.randn(shape)]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    shape = (BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"])
    return [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(3)]


def flex_mods(*inputs):
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return None, causal
