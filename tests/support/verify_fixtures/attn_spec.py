"""Spec: plain attention, fp32, MHA, self-attention (Sq == Skv)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, H, S, D]
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        if self.causal:
            s_q, s_k = q.shape[-2], k.shape[-2]
            mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


def get_inputs():
    return [torch.randn(2, 2, 64, 32) for _ in range(3)]


def get_init_inputs():
    return [False]
