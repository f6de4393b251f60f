"""FlexAttention style: Gemma-2 global layer (causal + softcap 50), GQA ratio 2.

Labelled retrieval spec (tests/data/specs).
"""
import torch

SHAPES = dict(B=1, Hq=8, Hkv=4, M=96, N=96, D=128, dtype="fp32")
LABEL = {
    "family": "fa2_cuda",
    "snippets": ["online_softmax", "mask_causal", "kv_loop_bounds", "softcap", "gqa"],
    "features": {"mask": "causal", "causal": True, "sliding_window": False, "score_mod": "softcap", "alibi": False,
                 "softcap": True, "gqa_ratio": 2, "head_dim": 128, "dtype": "fp32", "decode": False, "split_kv": False,
                 "cross": False},
}


def score_mod(score, b, h, q_idx, kv_idx):
    return 50.0 * torch.tanh(score / 50.0)


def mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
