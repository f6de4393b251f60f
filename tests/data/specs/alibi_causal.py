"""BLOOM-style ALiBi with causal mask.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import math

import torch
import torch.nn as nn

B, HQ, HKV, SQ, SKV, D = 1, 8, 8, 64, 64, 64
DTYPE = torch.float32

LABEL = {
    "family": "triton_fwd",
    "snippets": [
        "online_softmax",
        "mask_causal",
        "kv_loop_bounds",
        "alibi"
    ],
    "features": {
        "mask": "causal",
        "causal": True,
        "sliding_window": False,
        "score_mod": "alibi",
        "alibi": True,
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
    def __init__(self, n_heads, max_len):
        super().__init__()
        self.register_buffer('slopes', torch.tensor([2.0 ** (-8.0 * (i + 1) / n_heads) for i in range(n_heads)]))
        self.register_buffer('causal', torch.tril(torch.ones(max_len, max_len)))

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        pos_q = torch.arange(s.shape[2])[:, None]
        pos_k = torch.arange(s.shape[3])[None, :]
        s = s + self.slopes.view(1, -1, 1, 1) * (pos_k - pos_q)
        n = s.shape[-1]
        s = s.masked_fill(self.causal[:n, :n] == 0, float('-inf'))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, SQ, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE), torch.randn(B, HKV, SKV, D, dtype=DTYPE)]


def get_init_inputs():
    return [HQ, SKV + 64]
