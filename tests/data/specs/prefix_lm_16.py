"""Prefix-LM: 16 prompt tokens visible to all, causal afterwards.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 4, 4, 96, 96, 64
DTYPE = torch.float32

LABEL = {
    "family": "cute_fa4",
    "snippets": [
        "online_softmax",
        "mask_mod"
    ],
    "features": {
        "mask": "prefix_lm",
        "causal": True,
        "sliding_window": False,
        "score_mod": "none",
        "alibi": False,
        "softcap": False,
        "gqa_ratio": 1,
        "head_dim": 64,
        "dtype": "fp32",
        "decode": False,
        "split_kv": False,
        "cross": False
    }
}


class Model(nn.Module):
    def __init__(self, prefix):
        super().__init__()
        self.prefix = prefix

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        i = torch.arange(s.shape[2])[:, None]
        j = torch.arange(s.shape[3])[None, :]
        s = s.masked_fill((j > i) & (j >= self.prefix), float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return [16]
