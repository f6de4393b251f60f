"""ALiBi whose slopes come from the power of two nearest below the head count (BLOOM's rule for other head
counts, simplified): at 4 and 8 heads the divisor is the head count, at 12 it is 8. No expression in Hq gives it,
so the kernel holds this head count (4) and must refuse another one rather than answer wrongly."""
import math

import torch
import torch.nn as nn

B, H, S, D = 1, 4, 40, 32


class Model(nn.Module):
    def forward(self, q, k, v):
        closest = 2 ** math.floor(math.log2(q.shape[1]))
        slopes = 2.0 ** (-8.0 * torch.arange(1, q.shape[1] + 1) / closest)
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(k.shape[2])[None, :]
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + slopes.view(-1, 1, 1) * (j - i)
        s = s.masked_fill(j > i, float("-inf"))
        return s.softmax(-1) @ v


def get_inputs():
    return [torch.randn(B, H, S, D) for _ in range(3)]


def get_init_inputs():
    return []
