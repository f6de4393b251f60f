"""attention-gym `generate_sta_mask_mod_3d` (attn_gym/masks/sta.py): sliding tile attention on a 4 x 8 x 8
video in 2 x 4 x 4 tiles, a 4 x 8 x 8 kernel (time x height x width)."""

import torch
from attn_gym.masks import generate_sta_mask_mod_3d

mask_mod = generate_sta_mask_mod_3d(canvas_twh=(4, 8, 8), kernel_twh=(2, 4, 4), tile_twh=(2, 4, 4))
SHAPES = dict(B=1, H=4, S=4 * 8 * 8, D=64, dtype=torch.bfloat16)
