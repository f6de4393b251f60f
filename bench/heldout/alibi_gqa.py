"""Combination: ALiBi + GQA, causal, bf16, D=64 (MPT/BLOOM-style biases with grouped KV heads).

Variant: score + m_h * (j - i) with m_h = 2 ** (-8 (h + 1) / Hq) computed in forward from
an arange over the *query* heads; causal via an additive upper-triangular -inf matrix;
KV head h // (Hq / Hkv) via repeat_interleave. fp32 math from bf16 inputs, bf16 output.
Small shape (CPU check): B=2, Hq=4, Hkv=2, S=130, D=64, bf16.
Bench shape (H200, bf16): B=8, Hq=16, Hkv=4, S=4096, D=64.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

BENCH = dict(B=8, Hq=16, Hkv=4, M=4096, N=4096, D=64)
SDPA = None


class Model(nn.Module):
    def forward(self, q, k, v):
        bsz, n_heads, seq, head_dim = q.shape
        group = n_heads // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        heads = torch.arange(n_heads, device=q.device, dtype=torch.float32)
        m = (2.0 ** (-8.0 * (heads + 1) / n_heads)).view(1, n_heads, 1, 1)
        pos = torch.arange(seq, device=q.device, dtype=torch.float32)
        distance = pos.view(1, -1) - pos.view(-1, 1)                     # j - i
        causal_bias = torch.triu(torch.full((seq, seq), float("-inf"), device=q.device), 1)
        s = q.float() @ k.transpose(-2, -1) / math.sqrt(head_dim)
        s = s + m * distance + causal_bias
        return (F.softmax(s, dim=-1) @ v).to(q.dtype)


def get_inputs():
    return [torch.randn(2, 4, 130, 64, dtype=torch.bfloat16),
            torch.randn(2, 2, 130, 64, dtype=torch.bfloat16),
            torch.randn(2, 2, 130, 64, dtype=torch.bfloat16)]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, Hq, Hkv, S, D = BENCH["B"], BENCH["Hq"], BENCH["Hkv"], BENCH["M"], BENCH["D"]
    return [torch.randn(B, Hq, S, D, dtype=torch.bfloat16, device=device),
            torch.randn(B, Hkv, S, D, dtype=torch.bfloat16, device=device),
            torch.randn(B, Hkv, S, D, dtype=torch.bfloat16, device=device)]


def flex_mods(*inputs):
    n_heads = inputs[0].shape[1]

    def alibi(score, b, h, q_idx, kv_idx):
        slope = 2.0 ** (-8.0 * (h + 1) / n_heads)
        return score + slope * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return alibi, causal
