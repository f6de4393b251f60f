"""Jagged causal document mask with GQA ratio 2.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 4, 2, 96, 96, 64
DTYPE = torch.float32

LABEL = {
    "family": "cute_fa4",
    "snippets": [
        "online_softmax",
        "mask_mod",
        "mask_causal",
        "gqa",
        "varlen"
    ],
    "features": {
        "mask": "document",
        "causal": True,
        "sliding_window": False,
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
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v, doc_ids):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = torch.einsum('bhid,bhjd->bhij', q, k) * (1.0 / math.sqrt(q.shape[-1]))
        same = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
        n = s.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        s = s.masked_fill(~(same & causal).unsqueeze(1), float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def doc_ids_for(batch, seq):
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(batch):
        cuts = sorted(torch.randperm(seq - 1, generator=g)[:3].add(1).tolist())
        lengths = [b - a for a, b in zip([0] + cuts, cuts + [seq])]
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows)


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), doc_ids_for(B, SKV)]


def get_init_inputs():
    return []
