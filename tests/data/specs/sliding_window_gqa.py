"""Causal sliding window 16 with GQA ratio 2.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 4, 2, 96, 96, 64
DTYPE = torch.float32

LABEL = {
    "family": "fa2_cuda",
    "snippets": [
        "online_softmax",
        "mask_local",
        "kv_loop_bounds",
        "gqa"
    ],
    "features": {
        "mask": "sliding_window",
        "causal": True,
        "sliding_window": True,
        "score_mod": "none",
        "alibi": False,
        "softcap": False,
        "gqa_ratio": 2,
        "head_dim": 64,
        "dtype": "fp32",
        "decode": False,
        "split_kv": False,
        "cross": False
    }
}


class Model(nn.Module):
    def __init__(self, window):
        super().__init__()
        self.window = window

    def forward(self, q, k, v):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = torch.einsum('bhid,bhjd->bhij', q, k) * (1.0 / math.sqrt(q.shape[-1]))
        i = torch.arange(s.shape[2])[:, None]
        j = torch.arange(s.shape[3])[None, :]
        s = s.masked_fill((j > i) | (i - j >= self.window), float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return [16]
