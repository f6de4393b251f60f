"""Packed documents, bidirectional within a document.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 2, 4, 4, 96, 96, 64
DTYPE = torch.float32

LABEL = {
    "family": "cute_fa4",
    "snippets": [
        "online_softmax",
        "mask_mod",
        "varlen"
    ],
    "features": {
        "mask": "document",
        "causal": False,
        "sliding_window": False,
        "score_mod": "none",
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
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v, doc_ids):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        same = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]
        s = s.masked_fill(~same, float('-inf'))
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
