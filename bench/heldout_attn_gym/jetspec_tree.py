"""attention-gym `generate_jetspec_tree_causal_mask_mod` (attn_gym/masks/jetspec.py): tree-causal
verification of 31 draft nodes (a binary tree) after a 100-key prefix; the ancestor matrix is a boolean
[31, 31] tensor, so the spec has 31 queries and 131 keys."""

import torch
from attn_gym.masks import build_tree_ancestor_matrix, generate_jetspec_tree_causal_mask_mod

PARENTS = [-1] + [(i - 1) // 2 for i in range(1, 31)]
ANCESTORS = build_tree_ancestor_matrix(PARENTS, device="cpu")
mask_mod = generate_jetspec_tree_causal_mask_mod(prefix_length=100, ancestor_matrix=ANCESTORS)
SHAPES = dict(B=2, H=4, M=31, N=100 + 31, D=64, dtype=torch.bfloat16)
