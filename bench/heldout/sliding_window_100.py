"""Causal sliding-window attention with a window of 100 keys (not a power of two), bf16.

Variant: query i sees keys j with 0 <= i - j < 100 (itself and the 99 previous keys),
built with torch.where on index comparisons. fp32 math from bf16 inputs, bf16 output.
Small shape (CPU check): B=2, H=2, S=250, D=128, bf16.
Bench shape (H200, bf16): B=4, H=16, S=8192, D=128.
"""
import math

import torch
import torch.nn as nn

WINDOW = 100

BENCH = dict(B=4, Hq=16, Hkv=16, M=8192, N=8192, D=128)
SDPA = None


class Model(nn.Module):
    def __init__(self, window=WINDOW):
        super().__init__()
        self.window = window

    def forward(self, q, k, v):
        t = q.shape[-2]
        rows = torch.arange(t, device=q.device).unsqueeze(1)
        cols = torch.arange(t, device=q.device).unsqueeze(0)
        keep = (cols <= rows) & (rows - cols < self.window)
        att = torch.matmul(q.float(), k.float().transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        att = torch.where(keep, att, torch.tensor(float("-inf"), device=q.device))
        att = att.softmax(dim=-1)
        return torch.matmul(att, v.float()).to(torch.bfloat16)


def get_inputs():
    return [torch.randn(2, 2, 250, 128).to(torch.bfloat16) for _ in range(3)]


def get_init_inputs():
    return [WINDOW]


def bench_inputs(device: str) -> list[torch.Tensor]:
    shape = (BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"])
    return [torch.randn(*shape, device=device).to(torch.bfloat16) for _ in range(3)]


def flex_mods(*inputs):
    def sliding_window_causal(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        in_window = q_idx - kv_idx < WINDOW
        return causal & in_window

    return None, sliding_window_causal
