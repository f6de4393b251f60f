"""Causal attention with a learnable bias added to every score (an nn.Parameter scalar).

Softmax is shift invariant, so the bias changes nothing and its gradient is exactly zero.
Labelled retrieval spec (tests/data/specs).
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 2, 2, 2, 40, 40, 32
DTYPE = torch.float32

LABEL = {
    "family": "cute_fa4",
    "snippets": ["online_softmax", "score_mod", "mask_causal", "kv_loop_bounds"],
    "features": {"mask": "causal", "causal": True, "sliding_window": False, "score_mod": "custom", "alibi": False,
                 "softcap": False, "gqa_ratio": 1, "head_dim": 32, "dtype": "fp32", "decode": False, "split_kv": False,
                 "cross": False},
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.tensor(0.5))

    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + self.bias
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE),
            torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return []
