"""attention-gym `generate_natten` (attn_gym/masks/natten.py): 2-D neighbourhood attention on a 16 x 12
canvas (row-major tokens), a 5 x 5 kernel clamped at the canvas edges."""

import torch
from attn_gym.masks import generate_natten

mask_mod = generate_natten(canvas_w=16, canvas_h=12, kernel_w=5, kernel_h=5)
SHAPES = dict(B=1, H=4, S=16 * 12, D=64, dtype=torch.bfloat16)
