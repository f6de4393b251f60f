"""Encoder-decoder cross attention: 64 decoder queries attend to 160 encoder keys, no mask.
q: [B, H, 64, D], k, v: [B, H, 160, D] fp32."""
import torch
import torch.nn as nn
import torch.nn.functional as F

B, H, SQ, SKV, D = 2, 4, 64, 160, 64


class Model(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def get_inputs():
    return [torch.randn(B, H, SQ, D), torch.randn(B, H, SKV, D), torch.randn(B, H, SKV, D)]


def get_init_inputs():
    return []
