"""Llama-style causal GQA, ratio 4, repeat_interleave.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 8, 2, 64, 64, 64
DTYPE = torch.float32

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
        "gqa_ratio": 4,
        "head_dim": 64,
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
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        i = torch.arange(s.shape[2]).view(-1, 1)
        j = torch.arange(s.shape[3]).view(1, -1)
        s = torch.where(j <= i, s, float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return []
