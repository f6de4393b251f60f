"""Decode, GQA ratio 8, 2048-token cache, head dim 128, bf16.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 16, 2, 1, 2048, 128
DTYPE = torch.bfloat16

LABEL = {
    "family": "triton_decode",
    "snippets": [
        "online_softmax",
        "gqa",
        "split_kv_combine"
    ],
    "features": {
        "mask": "none",
        "causal": False,
        "sliding_window": False,
        "score_mod": "none",
        "alibi": False,
        "softcap": False,
        "gqa_ratio": 8,
        "head_dim": 128,
        "dtype": "bf16",
        "decode": True,
        "split_kv": True,
        "cross": False
    }
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = (q @ k.transpose(2, 3)) * q.shape[-1] ** -0.5
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return []
