"""Tuning spec (not held out): decode, one new query token per sequence over a KV cache, GQA 4:1, bf16."""
import math

import torch
import torch.nn as nn

B, HQ, HKV, N, D = 2, 4, 1, 400, 128
BENCH = [dict(B=128, Hq=16, Hkv=4, M=1, N=8192, D=64), dict(B=64, Hq=32, Hkv=8, M=1, N=16384, D=128)]
SDPA = "none"


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache):
        r = q.shape[1] // k_cache.shape[1]
        k, v = k_cache.repeat_interleave(r, 1), v_cache.repeat_interleave(r, 1)
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return (s.softmax(-1) @ v.float()).to(q.dtype)


def get_inputs():
    return [torch.randn(B, HQ, 1, D, dtype=torch.bfloat16), torch.randn(B, HKV, N, D, dtype=torch.bfloat16),
            torch.randn(B, HKV, N, D, dtype=torch.bfloat16)]


def get_init_inputs():
    return []


def bench_inputs(device, shape):
    g = lambda h, n: torch.randn(shape["B"], h, n, shape["D"], device=device, dtype=torch.bfloat16)  # noqa: E731
    return [g(shape["Hq"], shape["M"]), g(shape["Hkv"], shape["N"]), g(shape["Hkv"], shape["N"])]


def flex_mods(*inputs):
    return None, None
