"""Causal sliding window of 48 keys, bf16, D=64.

Variant: query i sees key j iff i - 48 < j <= i (the 48 most recent keys, itself included).
Written with a bool band from torch.ones(...).tril() minus tril(-48), masked_fill -inf.
fp32 math from bf16 inputs, bf16 output.
Small shape (CPU check): B=2, H=2, S=190, D=64, bf16.
Bench shape (H200, bf16): B=4, H=16, S=8192, D=64.
"""
import torch
import torch.nn as nn

WINDOW = 48
BENCH = dict(B=4, Hq=16, Hkv=16, M=8192, N=8192, D=64)
SDPA = None


class Model(nn.Module):
    def forward(self, q, k, v):
        S = q.shape[2]
        ones = torch.ones(S, S, dtype=torch.bool, device=q.device)
        band = ones.tril() & ~ones.tril(-WINDOW)
        s = q.float() @ k.float().transpose(2, 3) / (q.shape[3] ** 0.5)
        s = s.masked_fill(~band, float("-inf"))
        return (torch.softmax(s, -1) @ v.float()).to(q.dtype)


def get_inputs():
    return [torch.randn(2, 2, 190, 64, dtype=torch.bfloat16) for _ in range(3)]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, H, S, D = BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"]
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16, device=device) for _ in range(3)]


def flex_mods(*inputs):
    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)

    return None, window
