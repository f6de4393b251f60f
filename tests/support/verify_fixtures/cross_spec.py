"""Spec: cross attention (Sq != Skv allowed), fp32."""
import torch
import torch.nn as nn

CROSS = True


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, -1) @ v


def get_inputs():
    return [torch.randn(1, 2, 16, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)]


def get_init_inputs():
    return []
