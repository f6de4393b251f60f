"""Plain causal attention through SDPA, head dim 128, bf16 (the baseline shape of the
performance goals, scaled down for CPU). q, k, v: [B, H, S, 128]."""
import torch
import torch.nn as nn
import torch.nn.functional as F

B, H, S, D = 1, 4, 128, 128


class Model(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def get_inputs():
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(3)]


def get_init_inputs():
    return []
