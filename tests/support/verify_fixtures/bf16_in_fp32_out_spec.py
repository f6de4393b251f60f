"""Spec: attention from bf16 inputs computed and returned in fp32 (no cast back), as the held-out cross attention.
Autograd gives q, k, v their gradients in bf16 whatever the spec computes in."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, q, k, v):
        s = q.float() @ k.float().transpose(-2, -1) * q.shape[-1] ** -0.5
        return torch.softmax(s, -1) @ v.float()


def get_inputs():
    return [torch.randn(1, 2, 24, 16, dtype=torch.bfloat16), torch.randn(1, 2, 40, 16, dtype=torch.bfloat16),
            torch.randn(1, 2, 40, 16, dtype=torch.bfloat16)]


def get_init_inputs():
    return []
