"""attention-gym `causal_mask` (attn_gym/masks/causal.py): causal attention, a plain function."""

import torch
from attn_gym.masks import causal_mask

mask_mod = causal_mask
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.bfloat16)
