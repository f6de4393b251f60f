"""MQA decode: one new token per sequence, 8 query heads on 1 KV head, B=128, bf16, D=128.

Variant: M = 1, no mask, every query head reads the single shared KV head (expand of the
cache along the head dim). fp32 math from bf16 inputs, bf16 output.
Small shape (CPU check): B=2, Hq=4, Hkv=1, M=1, N=517, D=128, bf16.
Bench shape (H200, bf16): B=128, Hq=8, Hkv=1, M=1, N=16384, D=128.
"""
import torch
import torch.nn as nn

BENCH = dict(B=128, Hq=8, Hkv=1, M=1, N=16384, D=128)
SDPA = "none"


class Model(nn.Module):
    def forward(self, q, k, v):
        B, Hq, _, D = q.shape
        k = k.expand(B, Hq, k.shape[2], D).float()
        v = v.expand(B, Hq, v.shape[2], D).float()
        p = torch.softmax(q.float() @ k.transpose(-1, -2) / D ** 0.5, dim=-1)
        return (p @ v).to(q.dtype)


def get_inputs():
    return [torch.randn(2, 4, 1, 128, dtype=torch.bfloat16),
            torch.randn(2, 1, 517, 128, dtype=torch.bfloat16),
            torch.randn(2, 1, 517, 128, dtype=torch.bfloat16)]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    b, hq, hkv, m, n, d = (BENCH[x] for x in ("B", "Hq", "Hkv", "M", "N", "D"))
    return [torch.randn(b, hq, m, d, dtype=torch.bfloat16, device=device),
            torch.randn(b, hkv, n, d, dtype=torch.bfloat16, device=device),
            torch.randn(b, hkv, n, d, dtype=torch.bfloat16, device=device)]


def flex_mods(*inputs):
    return None, None
