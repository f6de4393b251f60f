"""Spec for the backward tests: causal attention, fp32, MHA, tiny and ragged (24 is not a multiple of 16)."""

import torch
import torch.nn as nn

CAUSAL = True


class Model(nn.Module):
    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # [B, H, Sq, Skv]
        if self.causal:
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


def get_inputs():
    return [torch.randn(1, 2, 24, 16) for _ in range(3)]


def get_init_inputs():
    return [True]
