"""Gemma-2: softcap 50 + causal + GQA ratio 2.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 8, 4, 64, 64, 128
DTYPE = torch.float32

LABEL = {
    "family": "fa2_cuda",
    "snippets": [
        "online_softmax",
        "mask_causal",
        "kv_loop_bounds",
        "softcap",
        "gqa"
    ],
    "features": {
        "mask": "causal",
        "causal": True,
        "sliding_window": False,
        "score_mod": "softcap",
        "alibi": False,
        "softcap": True,
        "gqa_ratio": 2,
        "head_dim": 128,
        "dtype": "fp32",
        "decode": False,
        "split_kv": False,
        "cross": False
    }
}


class Model(nn.Module):
    def __init__(self, cap):
        super().__init__()
        self.cap = cap

    def forward(self, q, k, v):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = self.cap * torch.tanh(s / self.cap)
        i = torch.arange(s.shape[2]).view(-1, 1)
        j = torch.arange(s.shape[3]).view(1, -1)
        s = torch.where(j <= i, s, float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return [50.0]
