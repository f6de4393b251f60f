"""attention-gym `generate_prefix_lm_mask` (attn_gym/masks/prefix_lm.py): the first 48 keys visible to
every query, causal after, built with `or_masks(prefix_mask, causal_mask)`."""

import torch
from attn_gym.masks import generate_prefix_lm_mask

mask_mod = generate_prefix_lm_mask(prefix_length=48)
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.bfloat16)
