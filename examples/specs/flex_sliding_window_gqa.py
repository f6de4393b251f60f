"""FlexAttention-style mask_mod plus a KernelBench Model in one file: causal sliding
window of 48 keys with GQA (8 query heads, 2 kv heads). The mods define the variant; the
Model (plain torch) is the reference and gives the shapes."""
import math

import torch
import torch.nn as nn

WINDOW = 48
B, HQ, HKV, S, D = 1, 8, 2, 128, 64


def mask_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


class Model(nn.Module):
    def forward(self, q, k, v):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        i = torch.arange(q.shape[2]).view(-1, 1)
        j = torch.arange(k.shape[2]).view(1, -1)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~mask_mod(0, 0, i, j), float("-inf"))
        return s.softmax(-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, S, D), torch.randn(B, HKV, S, D), torch.randn(B, HKV, S, D)]


def get_init_inputs():
    return []
