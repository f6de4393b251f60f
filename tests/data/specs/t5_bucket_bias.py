"""T5-style bucketed relative-position bias: a learnable nn.Embedding table indexed by log-spaced buckets.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
The bucket is computed in fp32 with torch.log and cast back with .long() (truncation toward zero);
MAX_DISTANCE = 22 keeps every integer distance >= 0.04 of a bucket away from a log-bucket boundary,
so fp32 log on any backend picks the same bucket. Keys before the query use the upper half of the
buckets. The table is an nn.Parameter: the kernel reads it at run time.
"""
import math

import torch
import torch.nn as nn

B, H, S, D = 1, 2, 48, 16
DTYPE = torch.float32
NUM_BUCKETS = 16
MAX_DISTANCE = 22

LABEL = {
    "family": "cute_fa4",
    "snippets": [
        "online_softmax",
        "score_mod"
    ],
    "features": {
        "mask": "none",
        "causal": False,
        "sliding_window": False,
        "score_mod": "relative_bias",
        "alibi": False,
        "softcap": False,
        "gqa_ratio": 1,
        "head_dim": 16,
        "dtype": "fp32",
        "decode": False,
        "split_kv": False,
        "cross": False
    }
}


def t5_bucket(rel: torch.Tensor) -> torch.Tensor:
    half = NUM_BUCKETS // 2
    exact = half // 2
    upper = (rel < 0).long() * half
    n = torch.abs(rel)
    scaled = torch.log(n.float().clamp(min=1.0) / exact) / math.log(MAX_DISTANCE / exact) * (half - exact)
    far = torch.minimum(exact + scaled.long(), torch.full_like(n, half - 1))
    return upper + torch.where(n < exact, n, far)


class Model(nn.Module):
    def __init__(self, n_heads):
        super().__init__()
        self.rel = nn.Embedding(NUM_BUCKETS, n_heads)

    def forward(self, q, k, v):
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
        n = s.shape[-1]
        pos = torch.arange(n)
        bias = self.rel(t5_bucket(pos[None, :] - pos[:, None])).permute(2, 0, 1)
        return torch.softmax(s + bias.unsqueeze(0), dim=-1) @ v


def get_inputs():
    return [torch.randn(B, H, S, D, dtype=DTYPE), torch.randn(B, H, S, D, dtype=DTYPE), torch.randn(B, H, S, D, dtype=DTYPE)]


def get_init_inputs():
    return [H]
