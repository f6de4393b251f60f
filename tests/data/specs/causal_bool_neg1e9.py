"""Causal attention, boolean tril and a -1e9 fill (HF style).

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 2, 2, 2, 80, 80, 32
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
        "head_dim": 32,
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
        q = q * (q.shape[-1] ** -0.5)
        s = q @ k.transpose(-1, -2)
        n = s.shape[-1]
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        s = s.masked_fill(~keep, -1e9)
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return []
