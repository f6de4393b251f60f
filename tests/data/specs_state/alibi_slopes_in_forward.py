"""ALiBi whose slopes are computed in forward from the head count: traced at 4 heads the slopes read
`exp2(-8.0 * (h + 1) / 4)`; traced again at 8 and 12 heads the 4 follows the head count, so the kernel computes
`/ Hq` and runs at any head count."""
import math

import torch
import torch.nn as nn

B, H, S, D = 1, 4, 40, 32


class Model(nn.Module):
    def forward(self, q, k, v):
        h = q.shape[1]
        slopes = 2.0 ** (-8.0 * torch.arange(1, h + 1) / h)
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(k.shape[2])[None, :]
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + slopes.view(-1, 1, 1) * (j - i)
        s = s.masked_fill(j > i, float("-inf"))
        return s.softmax(-1) @ v


def get_inputs():
    return [torch.randn(B, H, S, D) for _ in range(3)]


def get_init_inputs():
    return []
