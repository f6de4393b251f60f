"""Bidirectional attention, bf16, scores divided by a learnable temperature (`s / self.temperature`).

Labelled retrieval spec (tests/data/specs).
"""
import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 2, 2, 64, 64, 64
DTYPE = torch.bfloat16

LABEL = {
    "family": "cute_fa4",
    "snippets": ["online_softmax", "score_mod"],
    "features": {"mask": "none", "causal": False, "sliding_window": False, "score_mod": "custom", "alibi": False,
                 "softcap": False, "gqa_ratio": 1, "head_dim": 64, "dtype": "bf16", "decode": False, "split_kv": False,
                 "cross": False},
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(6.0))

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) / self.temperature
        return torch.matmul(torch.softmax(s, dim=-1), v)


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE),
            torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return []
