"""Tuning spec (not held out): a LEARNABLE clipped relative-position bias (Shaw et al. 2018), bidirectional, bf16.

score = q k^T / sqrt(D) + table[h, clamp(j - i, -K, K) + K], the table an nn.Parameter [H, 2K+1] (K = 12: 25
entries per head), so the backward owes its gradient beside dq, dk, dv. It stands for the learnable-table backwards
(`Features.learned_table`) whose designs the frozen tables' sweeps do not rank. fp32 math from bf16 inputs.
"""
import math

import torch
import torch.nn as nn

B, H, S, D = 1, 2, 140, 64
K = 12
BENCH = [dict(B=4, Hq=16, Hkv=16, M=4096, N=4096, D=64)]
SDPA = None


def _table(heads):
    g = torch.Generator().manual_seed(11)
    return 0.5 * torch.randn(heads, 2 * K + 1, generator=g)


class Model(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.table = nn.Parameter(_table(heads))

    def forward(self, q, k, v):
        m, n = q.shape[2], k.shape[2]
        rel = (torch.arange(n)[None, :] - torch.arange(m)[:, None]).clamp(-K, K) + K
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1]) + self.table[:, rel]
        return (s.softmax(-1) @ v.float()).to(q.dtype)


def get_inputs():
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(3)]


def get_init_inputs():
    return [H]


def bench_init_inputs():
    return [16]


def bench_inputs(device, shape):
    g = lambda h, n: torch.randn(shape["B"], h, n, shape["D"], device=device, dtype=torch.bfloat16)  # noqa: E731
    return [g(shape["Hq"], shape["M"]), g(shape["Hkv"], shape["N"]), g(shape["Hkv"], shape["N"])]


def flex_mods(q, k, v, model=None):
    table = model.table if model is not None else _table(q.shape[1]).to(q.device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, (kv_idx - q_idx).clamp(-K, K) + K]

    return score_mod, None
