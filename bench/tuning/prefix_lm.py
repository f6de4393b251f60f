"""Tuning spec (not held out): prefix-LM, a bidirectional prefix of per-batch length, causal after it, bf16."""
import math

import torch
import torch.nn as nn

B, H, S, D = 2, 2, 210, 128
BENCH = [dict(B=8, Hq=16, Hkv=16, M=4096, N=4096, D=64), dict(B=4, Hq=16, Hkv=16, M=8192, N=8192, D=128)]
SDPA = None


class Model(nn.Module):
    def forward(self, q, k, v, prefix):
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(k.shape[2])[None, :]
        keep = (j[None] < prefix[:, None, None]) | (j <= i)[None]
        s = s.masked_fill(~keep[:, None], float("-inf"))
        return (s.softmax(-1) @ v.float()).to(q.dtype)


def get_inputs():
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(3)] + [torch.tensor([37, 120], dtype=torch.int32)]


def get_init_inputs():
    return []


def bench_inputs(device, shape):
    g = lambda h, n: torch.randn(shape["B"], h, n, shape["D"], device=device, dtype=torch.bfloat16)  # noqa: E731
    prefix = torch.linspace(256, shape["N"] // 2, shape["B"]).to(torch.int32).to(device)
    return [g(shape["Hq"], shape["M"]), g(shape["Hkv"], shape["N"]), g(shape["Hkv"], shape["N"]), prefix]


def flex_mods(q, k, v, prefix):
    return None, lambda b, h, q_idx, kv_idx: (kv_idx < prefix[b]) | (q_idx >= kv_idx)
