"""Causal GQA (4 query heads over 2 KV heads) with a learnable temperature per query head,
`nn.Parameter` of shape [H] broadcast over each head's scores.

Labelled retrieval spec (tests/data/specs).
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 4, 2, 48, 48, 32
DTYPE = torch.float32

LABEL = {
    "family": "cute_fa4",
    "snippets": ["online_softmax", "score_mod", "mask_causal", "kv_loop_bounds", "gqa"],
    "features": {"mask": "causal", "causal": True, "sliding_window": False, "score_mod": "custom", "alibi": False,
                 "softcap": False, "gqa_ratio": 2, "head_dim": 32, "dtype": "fp32", "decode": False, "split_kv": False,
                 "cross": False},
}


class Model(nn.Module):
    def __init__(self, n_heads):
        super().__init__()
        self.temperature = nn.Parameter(torch.linspace(0.5, 2.0, n_heads))

    def forward(self, q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s * self.temperature.view(1, -1, 1, 1)
        n = q.shape[2]
        causal = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
        s = s.masked_fill(~causal, float("-inf"))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE),
            torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return [HQ]
