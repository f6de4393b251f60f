"""Causal GQA ratio 2 via expand+reshape, bf16.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 8, 4, 64, 64, 128
DTYPE = torch.bfloat16

LABEL = {
    "family": "triton_fwd",
    "snippets": [
        "online_softmax",
        "mask_causal",
        "kv_loop_bounds",
        "gqa"
    ],
    "features": {
        "mask": "causal",
        "causal": True,
        "sliding_window": False,
        "score_mod": "none",
        "alibi": False,
        "softcap": False,
        "gqa_ratio": 2,
        "head_dim": 128,
        "dtype": "bf16",
        "decode": False,
        "split_kv": False,
        "cross": False
    }
}


class Model(nn.Module):
    def __init__(self, max_len):
        super().__init__()
        self.register_buffer('causal', torch.tril(torch.ones(max_len, max_len)))

    def forward(self, q, k, v):
        b_, hkv, n_, d_ = k.shape
        g = q.shape[1] // hkv
        k = k.unsqueeze(2).expand(b_, hkv, g, n_, d_).reshape(b_, hkv * g, n_, d_)
        v = v.unsqueeze(2).expand(b_, hkv, g, n_, d_).reshape(b_, hkv * g, n_, d_)
        s = (q @ k.transpose(2, 3)) * q.shape[-1] ** -0.5
        n = s.shape[-1]
        s = s.masked_fill(self.causal[:n, :n] == 0, float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return [SKV + 64]
