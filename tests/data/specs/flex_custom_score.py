"""FlexAttention style: a custom score_mod (per-head temperature on a sigmoid-gated
score) with a causal mask; nothing in the expert kernels implements it directly.

Labelled retrieval spec (tests/data/specs).
"""
import torch

SHAPES = dict(B=1, Hq=4, Hkv=4, M=64, N=64, D=64, dtype="fp32")
TEMPERATURE = torch.tensor([1.0, 0.5, 2.0, 1.5])
LABEL = {
    "family": "cute_fa4",
    "snippets": ["online_softmax", "score_mod", "mask_causal", "kv_loop_bounds"],
    "features": {"mask": "causal", "causal": True, "sliding_window": False, "score_mod": "custom", "alibi": False,
                 "softcap": False, "gqa_ratio": 1, "head_dim": 64, "dtype": "fp32", "decode": False, "split_kv": False,
                 "cross": False},
}


def score_mod(score, b, h, q_idx, kv_idx):
    return score * TEMPERATURE[h] + torch.sigmoid(score)


def mask_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx
