"""Prefix-LM with a constant prefix of 64 tokens (module constant), bf16, D=128.

Variant: the first PREFIX keys are visible to every query (bidirectional prefix); after
that, attention is causal: key j is visible to query i iff j < PREFIX or j <= i.
Written as a bool mask buffer-free expression with torch.where. fp32 math, bf16 output.
Small shape (CPU check): B=2, H=2, S=150, D=128, bf16.
Bench shape (H200, bf16): B=4, H=16, S=8192, D=128.
"""
import torch
import torch.nn as nn

PREFIX = 64
BENCH = dict(B=4, Hq=16, Hkv=16, M=8192, N=8192, D=128)
SDPA = None


class Model(nn.Module):
    def forward(self, q, k, v):
        S = q.size(-2)
        i = torch.arange(S, device=q.device)[:, None]
        j = torch.arange(S, device=q.device)[None, :]
        visible = (j < PREFIX) | (j <= i)
        s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * q.size(-1) ** -0.5
        s = torch.where(visible, s, float("-inf"))
        return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.float()).to(q.dtype)


def get_inputs():
    return [torch.randn(2, 2, 150, 128, dtype=torch.bfloat16) for _ in range(3)]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, H, S, D = BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"]
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16, device=device) for _ in range(3)]


def flex_mods(*inputs):
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < PREFIX) | (kv_idx <= q_idx)

    return None, prefix_lm
