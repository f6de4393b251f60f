"""Chunked prefill: 32 queries at the end of 160 positions, bottom-right causal.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 4, 4, 32, 160, 64
DTYPE = torch.float32

LABEL = {
    "family": "triton_fwd",
    "snippets": [
        "online_softmax",
        "mask_causal",
        "kv_loop_bounds",
        "mask_bounds"
    ],
    "features": {
        "mask": "causal",
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
        "cross": True
    }
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        m, n = s.shape[2], s.shape[3]
        i = torch.arange(m)[:, None] + (n - m)
        j = torch.arange(n)[None, :]
        s = s.masked_fill(j > i, float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return []
