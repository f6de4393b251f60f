"""Causal attention built from arange comparisons, head dim 128.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 4, 4, 64, 64, 128
DTYPE = torch.float32

LABEL = {
    "family": "triton_fwd",
    "snippets": [
        "online_softmax",
        "mask_causal",
        "kv_loop_bounds"
    ],
    "features": {
        "mask": "causal",
        "causal": True,
        "sliding_window": False,
        "score_mod": "none",
        "alibi": False,
        "softcap": False,
        "gqa_ratio": 1,
        "head_dim": 128,
        "dtype": "fp32",
        "decode": False,
        "split_kv": False,
        "cross": False
    }
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        s = (q @ k.transpose(2, 3)) * q.shape[-1] ** -0.5
        i = torch.arange(s.shape[2]).view(-1, 1)
        j = torch.arange(s.shape[3]).view(1, -1)
        s = torch.where(j <= i, s, float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return []
