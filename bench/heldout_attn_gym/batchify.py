"""attention-gym `batchify_mask_mod(causal_mask, 64)` (attn_gym/masks/batchify.py): groups of 64 tokens,
causal inside each group."""

import torch
from attn_gym.masks import batchify_mask_mod, causal_mask

mask_mod = batchify_mask_mod(causal_mask, batchify_size=64)
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.bfloat16)
