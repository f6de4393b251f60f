"""Causal attention with a wider value head: D_qk = 64, D_v = 128, bf16.

Variant: causal; q and k have head dim 64, v and the output 128 (MLA-style value heads).
Additive -inf bias from torch.triu. fp32 math from bf16 inputs, bf16 output.
Small shape (CPU check): B=2, H=2, S=170, D_qk=64, D_v=128, bf16.
Bench shape (H200, bf16): B=4, H=16, S=8192, D_qk=64, D_v=128 (BENCH key Dv).
"""
import torch
import torch.nn as nn

BENCH = dict(B=4, Hq=16, Hkv=16, M=8192, N=8192, D=64, Dv=128)
SDPA = "causal"


class Model(nn.Module):
    def forward(self, q, k, v):
        S = q.shape[-2]
        bias = torch.full((S, S), float("-inf"), device=q.device).triu(1)
        s = q.float() @ k.float().mT * q.shape[-1] ** -0.5 + bias
        return (s.softmax(-1) @ v.float()).to(v.dtype)


def get_inputs():
    return [torch.randn(2, 2, 170, 64, dtype=torch.bfloat16),
            torch.randn(2, 2, 170, 64, dtype=torch.bfloat16),
            torch.randn(2, 2, 170, 128, dtype=torch.bfloat16)]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, H, S, D, Dv = (BENCH[x] for x in ("B", "Hq", "M", "D", "Dv"))
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16, device=device),
            torch.randn(B, H, S, D, dtype=torch.bfloat16, device=device),
            torch.randn(B, H, S, Dv, dtype=torch.bfloat16, device=device)]


def flex_mods(*inputs):
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return None, causal
