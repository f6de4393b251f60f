"""attention-gym `generate_dilated_sliding_window` (attn_gym/masks/dilated_sliding_window.py): |i - j| <= 32
and |i - j| divisible by 2."""

import torch
from attn_gym.masks import generate_dilated_sliding_window

mask_mod = generate_dilated_sliding_window(window_size=32, dilation=2)
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.bfloat16)
