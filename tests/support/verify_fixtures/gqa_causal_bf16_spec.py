"""Spec: causal GQA attention in bf16 (Hq=4, Hkv=2), self-attention; the harness may vary Hkv."""

import torch
import torch.nn as nn

CAUSAL = True


class Model(nn.Module):
    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)


def get_inputs():
    q = torch.randn(1, 4, 32, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 32, 16, dtype=torch.bfloat16)
    v = torch.randn(1, 2, 32, 16, dtype=torch.bfloat16)
    return [q, k, v]


def get_init_inputs():
    return [True]
