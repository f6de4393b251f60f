"""Causal attention whose scores are multiplied by a learnable temperature (`self.t`, an nn.Parameter scalar).

Its gradient is the sum of dS * s over every pair of every head (issue #29, item 7).
Labelled retrieval spec (tests/data/specs).
"""
import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 2, 2, 70, 70, 32
DTYPE = torch.float32

LABEL = {
    "family": "cute_fa4",
    "snippets": ["online_softmax", "score_mod", "mask_causal", "kv_loop_bounds"],
    "features": {"mask": "causal", "causal": True, "sliding_window": False, "score_mod": "custom", "alibi": False,
                 "softcap": False, "gqa_ratio": 1, "head_dim": 32, "dtype": "fp32", "decode": False, "split_kv": False,
                 "cross": False},
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(0.7))

    def forward(self, q, k, v):
        s = (q @ k.transpose(-2, -1)) * self.t
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE),
            torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return []
