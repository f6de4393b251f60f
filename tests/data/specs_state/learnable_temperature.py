"""A learnable temperature: scores scaled by a scalar nn.Parameter with a random initial value.
The kernel must read `t` at run time (ModelNew.t, loaded from Model's state_dict)."""
import math

import torch
import torch.nn as nn

B, H, S, D = 1, 2, 32, 16


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.rand(()) + 0.5)

    def forward(self, q, k, v):
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) * self.t
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)]


def get_init_inputs():
    return []
