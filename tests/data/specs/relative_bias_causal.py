"""Relative-position bias with causal mask (decoder).

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 4, 4, 64, 64, 64
DTYPE = torch.float32

LABEL = {
    "family": "cute_fa4",
    "snippets": [
        "online_softmax",
        "mask_causal",
        "kv_loop_bounds",
        "score_mod"
    ],
    "features": {
        "mask": "causal",
        "causal": True,
        "sliding_window": False,
        "score_mod": "relative_bias",
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
    def __init__(self, n_heads, seq, max_len):
        super().__init__()
        self.rel = nn.Parameter(torch.randn(n_heads, 2 * seq - 1) * 0.3)
        self.register_buffer('causal', torch.tril(torch.ones(max_len, max_len)))

    def forward(self, q, k, v):
        s = (q @ k.transpose(2, 3)) * q.shape[-1] ** -0.5
        n = s.shape[-1]
        idx = torch.arange(n)[:, None] - torch.arange(n)[None, :] + n - 1
        s = s + self.rel[:, idx].unsqueeze(0)
        n = s.shape[-1]
        s = s.masked_fill(self.causal[:n, :n] == 0, float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return [HQ, SKV, SKV + 64]
