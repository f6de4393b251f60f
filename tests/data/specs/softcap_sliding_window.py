"""Gemma-2 local layer: softcap + sliding window 32.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 4, 4, 96, 96, 64
DTYPE = torch.float32

LABEL = {
    "family": "fa2_cuda",
    "snippets": [
        "online_softmax",
        "mask_local",
        "kv_loop_bounds",
        "softcap"
    ],
    "features": {
        "mask": "sliding_window",
        "causal": True,
        "sliding_window": True,
        "score_mod": "softcap",
        "alibi": False,
        "softcap": True,
        "gqa_ratio": 1,
        "head_dim": 64,
        "dtype": "fp32",
        "decode": False,
        "split_kv": False,
        "cross": False
    }
}


class Model(nn.Module):
    def __init__(self, cap, window):
        super().__init__()
        self.cap = cap
        self.window = window

    def forward(self, q, k, v):
        s = (q @ k.transpose(2, 3)) * q.shape[-1] ** -0.5
        s = self.cap * torch.tanh(s / self.cap)
        i = torch.arange(s.shape[2])[:, None]
        j = torch.arange(s.shape[3])[None, :]
        s = s.masked_fill((j > i) | (i - j >= self.window), float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return [50.0, 32]
