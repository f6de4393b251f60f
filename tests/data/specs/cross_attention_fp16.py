"""Decoder-to-encoder cross attention, 48 queries over 176 keys, fp16.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 2, 4, 4, 48, 176, 64
DTYPE = torch.float16

LABEL = {
    "family": "cutlass_fmha",
    "snippets": [
        "online_softmax",
        "mask_bounds"
    ],
    "features": {
        "mask": "none",
        "causal": False,
        "sliding_window": False,
        "score_mod": "none",
        "alibi": False,
        "softcap": False,
        "gqa_ratio": 1,
        "head_dim": 64,
        "dtype": "fp16",
        "decode": False,
        "split_kv": False,
        "cross": True
    }
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return []
