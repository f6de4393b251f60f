"""Benchmark spec 'plain' (bf16, D=128): the variant `kb bench` times at S=1K..16K.
Small default shapes so that `kb generate` can verify it on CPU; the generated IR is shape-generic."""
import math

import torch
import torch.nn as nn

B, H, HKV, S, D = 1, 2, 2, 256, 128
DT = torch.bfloat16


class Model(nn.Module):
    pass
    def forward(self, q, k, v):
        s = torch.matmul(q.float(), k.float().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)) / math.sqrt(q.shape[-1])
        pass
        p = torch.softmax(s, dim=-1)
        return torch.matmul(p, v.float().repeat_interleave(q.shape[1] // k.shape[1], 1)).to(q.dtype)


def get_inputs():
    return [torch.randn(B, H, S, D, dtype=DT), torch.randn(B, HKV, S, D, dtype=DT), torch.randn(B, HKV, S, D, dtype=DT)]


def get_init_inputs():
    return []
