"""Combination: causal sliding window (112 keys) + tanh logit softcap (cap 20), GQA 2:1, bf16, D=128.

Gemma-2 local-layer style: s = 20 * tanh(q k^T / sqrt(D) / 20); query i sees keys j with
0 <= i - j < 112 (not a power of two); KV heads shared by pairs of query heads
(repeat_interleave). Mask applied with masked_fill after the cap. fp32 math from bf16
inputs, bf16 output. q is scaled by 4 in the inputs so the cap is active.
Small shape (CPU check): B=1, Hq=4, Hkv=2, S=288, D=128, bf16.
Bench shape (H200, bf16): B=4, Hq=16, Hkv=8, S=8192, D=128.
"""
import math

import torch
import torch.nn as nn

LOCAL_WINDOW = 112
LOGIT_CAP = 20.0

BENCH = dict(B=4, Hq=16, Hkv=8, M=8192, N=8192, D=128)
SDPA = None


class Model(nn.Module):
    def __init__(self, window: int, cap: float):
        super().__init__()
        self.window = window
        self.cap = cap

    def forward(self, q, k, v):
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        S = q.shape[2]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = torch.tanh(scores / self.cap) * self.cap
        q_pos = torch.arange(S, device=q.device)[:, None]
        k_pos = torch.arange(S, device=q.device)[None, :]
        outside = (k_pos > q_pos) | (q_pos - k_pos >= self.window)
        scores = scores.masked_fill(outside, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        return torch.matmul(p, v.float()).to(q.dtype)


def get_inputs():
    q = (4 * torch.randn(1, 4, 288, 128)).to(torch.bfloat16)
    k = torch.randn(1, 2, 288, 128).to(torch.bfloat16)
    v = torch.randn(1, 2, 288, 128).to(torch.bfloat16)
    return [q, k, v]


def get_init_inputs():
    return [LOCAL_WINDOW, LOGIT_CAP]


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, Hq, Hkv, S, D = (BENCH[key] for key in ("B", "Hq", "Hkv", "M", "D"))
    q = (4 * torch.randn(B, Hq, S, D, device=device)).to(torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device=device).to(torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device=device).to(torch.bfloat16)
    return [q, k, v]


def flex_mods(*inputs):
    def softcap(score, b, h, q_idx, kv_idx):
        return LOGIT_CAP * torch.tanh(score / LOGIT_CAP)

    def local_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < LOCAL_WINDOW)

    return softcap, local_causal
