"""Symmetric ALiBi -slope*|i-j| for an encoder, no mask.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 4, 4, 64, 64, 64
DTYPE = torch.float32

LABEL = {
    "family": "triton_fwd",
    "snippets": [
        "online_softmax",
        "alibi"
    ],
    "features": {
        "mask": "none",
        "causal": False,
        "sliding_window": False,
        "score_mod": "alibi",
        "alibi": True,
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
    def __init__(self, n_heads):
        super().__init__()
        self.register_buffer('slopes', torch.tensor([2.0 ** (-8.0 * (i + 1) / n_heads) for i in range(n_heads)]))

    def forward(self, q, k, v):
        s = (q @ k.transpose(2, 3)) * q.shape[-1] ** -0.5
        rel = (torch.arange(s.shape[2])[:, None] - torch.arange(s.shape[3])[None, :]).abs()
        s = s - self.slopes[None, :, None, None] * rel
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return [HQ]
