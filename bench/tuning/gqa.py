"""Tuning spec (not held out): causal GQA, 4 query heads per KV head, bf16. D=64 and D=128."""
import math

import torch
import torch.nn as nn

B, HQ, HKV, S, D = 1, 4, 1, 180, 128
BENCH = [dict(B=8, Hq=16, Hkv=4, M=4096, N=4096, D=64), dict(B=4, Hq=32, Hkv=8, M=8192, N=8192, D=128)]
SDPA = "causal"


class Model(nn.Module):
    def forward(self, q, k, v):
        r = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return (s.softmax(-1) @ v.float()).to(q.dtype)


def get_inputs():
    return [torch.randn(B, HQ, S, D, dtype=torch.bfloat16), torch.randn(B, HKV, S, D, dtype=torch.bfloat16),
            torch.randn(B, HKV, S, D, dtype=torch.bfloat16)]


def get_init_inputs():
    return []


def bench_inputs(device, shape):
    g = lambda h, n: torch.randn(shape["B"], h, n, shape["D"], device=device, dtype=torch.bfloat16)  # noqa: E731
    return [g(shape["Hq"], shape["M"]), g(shape["Hkv"], shape["N"]), g(shape["Hkv"], shape["N"])]


def flex_mods(*inputs):
    return None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
