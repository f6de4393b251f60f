"""attention-gym `generate_sta_mask_mod_2d` (attn_gym/masks/sta.py): sliding tile attention on a 16 x 16
canvas in 4 x 4 tiles, an 8 x 8 kernel, plus 32 text tokens that see everything."""

import torch
from attn_gym.masks import generate_sta_mask_mod_2d

mask_mod = generate_sta_mask_mod_2d(canvas_hw=(16, 16), kernel_hw=(8, 8), tile_hw=(4, 4), text_seq_len=32)
SHAPES = dict(B=1, H=4, S=16 * 16 + 32, D=64, dtype=torch.bfloat16)
