"""FlexAttention style: block-sparse attention from a per-head 16x16-block layout
(BigBird/Longformer style). BLOCK_LAYOUT: [H, M/16, N/16] bool.

Labelled retrieval spec (tests/data/specs).
"""
import torch

SHAPES = dict(B=1, Hq=4, Hkv=4, M=128, N=128, D=64, dtype="fp32")
_g = torch.Generator().manual_seed(3)
BLOCK_LAYOUT = torch.rand(4, 8, 8, generator=_g) < 0.4
BLOCK_LAYOUT |= torch.eye(8, dtype=torch.bool)  # every query block sees its own block
LABEL = {
    "family": "cute_fa4",
    "snippets": ["online_softmax", "block_sparse", "mask_mod", "kv_loop_bounds"],
    "features": {"mask": "block_sparse", "causal": False, "sliding_window": False, "score_mod": "none", "alibi": False,
                 "softcap": False, "gqa_ratio": 1, "head_dim": 64, "dtype": "fp32", "decode": False, "split_kv": False,
                 "cross": False},
}


def mask_mod(b, h, q_idx, kv_idx):
    return BLOCK_LAYOUT[h, q_idx // 16, kv_idx // 16]
