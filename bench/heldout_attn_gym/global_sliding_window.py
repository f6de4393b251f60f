"""attention-gym `generate_global_sliding_window` (attn_gym/masks/global_sliding_window.py): Longformer's
|i - j| <= 24 window or-ed with global tokens (a boolean tensor `is_global` [S], here every 50th token),
built with `or_masks`."""

import torch
from attn_gym.masks import generate_global_sliding_window

S = 210
IS_GLOBAL = torch.zeros(S, dtype=torch.bool)
IS_GLOBAL[::50] = True
mask_mod = generate_global_sliding_window(window_size=24, is_global=IS_GLOBAL)
SHAPES = dict(B=2, H=4, S=S, D=64, dtype=torch.bfloat16)
