"""A spec error: a random bias held as a plain tensor attribute (not a parameter or buffer).
Every Model(*get_init_inputs()) draws a new one and no state_dict carries it, so no kernel can
match the Model a verifier builds: refused when the spec is loaded."""
import math

import torch
import torch.nn as nn

B, H, S, D = 1, 2, 32, 16


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.randn(H, S, S) * 0.5

    def forward(self, q, k, v):
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) + self.bias
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)]


def get_init_inputs():
    return []
