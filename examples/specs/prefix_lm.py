"""Prefix-LM attention (T5/UniLM/PaliGemma): the first PREFIX tokens (the prompt) are
visible to every query, the rest is causal. q, k, v: [B, H, S, D] fp32."""
import math

import torch
import torch.nn as nn

B, H, S, D, PREFIX = 2, 4, 128, 64, 24


class Model(nn.Module):
    def __init__(self, prefix: int):
        super().__init__()
        self.prefix = prefix

    def forward(self, q, k, v):
        n = q.shape[2]
        i = torch.arange(n).unsqueeze(1)
        j = torch.arange(n).unsqueeze(0)
        visible = (j < self.prefix) | (j <= i)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = torch.where(visible, scores, torch.full_like(scores, float("-inf")))
        return torch.softmax(scores, -1) @ v


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)]


def get_init_inputs():
    return [PREFIX]
