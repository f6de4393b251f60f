"""Causal self-attention, head dim 128, bf16 (LLaMA-style prefill without GQA).

Variant: causal via an additive upper-triangular -inf bias; the scale is applied to q
before the product. Computes in fp32 from bf16 inputs, returns bf16.
Small shape (CPU check): B=1, H=4, S=237, D=128, bf16.
Bench shape (H200, bf16): B=4, H=32, S=8192, D=128.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

BENCH = dict(B=4, Hq=32, Hkv=32, M=8192, N=8192, D=128)
SDPA = "causal"


class Model(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        self.scale = head_dim ** -0.5

    def forward(self, q, k, v):
        L = q.shape[2]
        bias = torch.triu(torch.full((L, L), float("-inf"), device=q.device), diagonal=1)
        logits = (q.float() * self.scale) @ k.float().transpose(2, 3) + bias
        probs = F.softmax(logits, dim=-1)
        return (probs @ v.float()).to(q.dtype)


def get_inputs():
    b, h, s, d = 1, 4, 237, 128
    return [torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(3)]


def get_init_inputs():
    return [128]


def bench_inputs(device: str) -> list[torch.Tensor]:
    b, h, s, d = BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"]
    return [torch.randn(b, h, s, d, dtype=torch.bfloat16, device=device) for _ in range(3)]


def flex_mods(*inputs):
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    return None, mask_mod
