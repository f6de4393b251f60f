"""Decode step: one new query token per sequence over a long KV cache, GQA, bf16, D=128.

Variant: M = 1, no mask (the query sees the whole cache), GQA with 4 query heads per KV
head at bench (repeat_interleave of the cache along the head dim). fp32 math from bf16
inputs, bf16 output.
Small shape (CPU check): B=2, Hq=4, Hkv=2, M=1, N=517, D=128, bf16.
Bench shape (H200, bf16): B=64, Hq=32, Hkv=8, M=1, N=16384, D=128.
"""
import torch
import torch.nn as nn

BENCH = dict(B=64, Hq=32, Hkv=8, M=1, N=16384, D=128)
SDPA = "none"

BATCH, Q_HEADS, KV_HEADS, CACHE_LEN, HEAD_DIM = 2, 4, 2, 517, 128


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache):
        groups = q.size(1) // k_cache.size(1)
        k = torch.repeat_interleave(k_cache, groups, dim=1).float()
        v = torch.repeat_interleave(v_cache, groups, dim=1).float()
        scores = torch.matmul(q.float(), k.transpose(-2, -1)) * (q.size(-1) ** -0.5)
        probs = scores.softmax(dim=-1)
        return torch.matmul(probs, v).to(q.dtype)


def get_inputs():
    q = torch.randn(BATCH, Q_HEADS, 1, HEAD_DIM, dtype=torch.bfloat16)
    k_cache = torch.randn(BATCH, KV_HEADS, CACHE_LEN, HEAD_DIM, dtype=torch.bfloat16)
    v_cache = torch.randn(BATCH, KV_HEADS, CACHE_LEN, HEAD_DIM, dtype=torch.bfloat16)
    return [q, k_cache, v_cache]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    b, hq, hkv, m, n, d = (BENCH[x] for x in ("B", "Hq", "Hkv", "M", "N", "D"))
    return [torch.randn(b, hq, m, d, dtype=torch.bfloat16, device=device),
            torch.randn(b, hkv, n, d, dtype=torch.bfloat16, device=device),
            torch.randn(b, hkv, n, d, dtype=torch.bfloat16, device=device)]


def flex_mods(*inputs):
    return None, None
