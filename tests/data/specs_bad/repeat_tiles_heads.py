"""Unsupported: kv heads tiled with repeat() (head j reads kv head j % Hkv), not GQA."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, q, k, v):
        k = k.repeat(1, 2, 1, 1)
        v = v.repeat(1, 2, 1, 1)
        return torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v


def get_inputs():
    return [torch.randn(1, 4, 16, 64), torch.randn(1, 2, 16, 64), torch.randn(1, 2, 16, 64)]


def get_init_inputs():
    return []
