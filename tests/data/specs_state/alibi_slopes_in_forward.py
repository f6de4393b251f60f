"""ALiBi whose slopes are computed in forward from the head count: the traced kernel holds the slopes of
this head count (4), so the candidate must refuse another one rather than answer wrongly."""
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
