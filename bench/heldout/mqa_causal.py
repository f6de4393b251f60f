"""Multi-query causal attention (PaLM / Falcon style: one shared KV head), fp32, D=64.

Variant: causal, MQA (Hkv = 1, every query head reads the single KV head), written with
F.scaled_dot_product_attention(is_causal=True, enable_gqa=True). fp32 in, fp32 out.
Small shape (CPU check): B=2, Hq=4, Hkv=1, S=128, D=64, fp32.
Bench shape (H200, bf16): B=8, Hq=16, Hkv=1, S=4096, D=64.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

BENCH = dict(B=8, Hq=16, Hkv=1, M=4096, N=4096, D=64)
SDPA = "causal"


class Model(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def get_inputs():
    return [torch.randn(2, 4, 128, 64), torch.randn(2, 1, 128, 64), torch.randn(2, 1, 128, 64)]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    b, hq, hkv, s, d = (BENCH[x] for x in ("B", "Hq", "Hkv", "M", "D"))
    return [torch.randn(b, hq, s, d, device=device, dtype=torch.bfloat16),
            torch.randn(b, hkv, s, d, device=device, dtype=torch.bfloat16),
            torch.randn(b, hkv, s, d, device=device, dtype=torch.bfloat16)]


def flex_mods(*inputs):
    return None, lambda b, h, q_idx, kv_idx: kv_idx <= q_idx
