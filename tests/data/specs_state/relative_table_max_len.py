"""A relative-position table sized by a constructor argument (Shaw et al. / T5 without buckets): `rel` has
2 * max_len - 1 columns and is read at i - j + max_len - 1, for any sequence up to max_len. Traced at max_len=64
the offset is the constant 63; traced with max_len 65 and 66 it follows the table's size, so the kernel reads
`(rel_n1 - 1) // 2` from the table it is given and serves a Model built with any max_len."""
import math

import torch
import torch.nn as nn

B, H, S, D = 1, 4, 40, 32


class Model(nn.Module):
    def __init__(self, n_heads, max_len):
        super().__init__()
        self.max_len = max_len
        self.rel = nn.Parameter(torch.randn(n_heads, 2 * max_len - 1) * 0.3)

    def forward(self, q, k, v):
        n = q.shape[2]
        idx = torch.arange(n)[:, None] - torch.arange(n)[None, :] + (self.max_len - 1)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + self.rel[:, idx].unsqueeze(0)
        return s.softmax(-1) @ v


def get_inputs():
    return [torch.randn(B, H, S, D) for _ in range(3)]


def get_init_inputs():
    return [H, 64]
