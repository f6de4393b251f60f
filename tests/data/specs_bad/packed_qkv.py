"""Unsupported: q, k, v sliced by indexing from one packed qkv tensor [B, 3, H, S, D]."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, qkv):
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        return torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v


def get_inputs():
    return [torch.randn(1, 3, 2, 16, 64)]


def get_init_inputs():
    return []
