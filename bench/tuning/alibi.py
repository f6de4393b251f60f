"""Tuning spec (not held out): causal ALiBi (slopes 2^(-8(h+1)/H)), bf16. Timed at D=64 and D=128."""
import math

import torch
import torch.nn as nn

B, H, S, D = 2, 4, 150, 128
BENCH = [dict(B=8, Hq=16, Hkv=16, M=4096, N=4096, D=64), dict(B=4, Hq=16, Hkv=16, M=8192, N=8192, D=128)]
SDPA = None


def _slopes(h):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])


class Model(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.register_buffer("slopes", _slopes(heads))

    def forward(self, q, k, v):
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(k.shape[2])[None, :]
        s = s + self.slopes.view(-1, 1, 1) * (j - i)
        s = s.masked_fill(j > i, float("-inf"))
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


def flex_mods(*inputs):
    slopes = _slopes(inputs[0].shape[1]).to(inputs[0].device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return score_mod, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
