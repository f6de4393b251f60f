"""Causal attention with tanh logit soft-capping (Gemma-2 / Grok style), bf16, D=64.

Variant: s = CAP * tanh((q k^T / sqrt(D)) / CAP) with CAP = 10, then causal mask built
from a lower-triangular matrix of ones and torch.where. fp32 math from bf16 inputs,
bf16 output. Small inputs have q scaled by 3 so that the cap is active.
Small shape (CPU check): B=1, H=4, S=300, D=64, bf16.
Bench shape (H200, bf16): B=8, H=16, S=4096, D=64.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CAP = 10.0

BENCH = dict(B=8, Hq=16, Hkv=16, M=4096, N=4096, D=64)
SDPA = None


class Model(nn.Module):
    def __init__(self, softcap: float = CAP):
        super().__init__()
        self.softcap = softcap

    def forward(self, q, k, v):
        dtype = q.dtype
        q, k, v = q.float(), k.float(), v.float()
        n = q.shape[-2]
        logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        logits = self.softcap * torch.tanh(logits / self.softcap)
        lower = torch.ones(n, n, device=q.device).tril().bool()
        logits = torch.where(lower, logits, float("-inf"))
        return (F.softmax(logits, dim=-1) @ v).to(dtype)


def get_inputs():
    q = (3.0 * torch.randn(1, 4, 300, 64)).to(torch.bfloat16)
    k = torch.randn(1, 4, 300, 64).to(torch.bfloat16)
    v = torch.randn(1, 4, 300, 64).to(torch.bfloat16)
    return [q, k, v]


def get_init_inputs():
    return [CAP]


def bench_inputs(device: str) -> list[torch.Tensor]:
    shape = (BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"])
    q = (3.0 * torch.randn(shape, device=device)).to(torch.bfloat16)
    k = torch.randn(shape, device=device).to(torch.bfloat16)
    v = torch.randn(shape, device=device).to(torch.bfloat16)
    return [q, k, v]


def flex_mods(*inputs):
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return CAP * torch.tanh(score / CAP)

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return tanh_softcap, causal_mask
