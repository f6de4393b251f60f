"""attention-gym `generate_sliding_window` (attn_gym/masks/sliding_window.py): a causal window of 64 keys,
built with `and_masks(sliding_window, causal_mask)`."""

import torch
from attn_gym.masks import generate_sliding_window

mask_mod = generate_sliding_window(window_size=64)
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.bfloat16)
