"""attention-gym `generate_morton_natten` (attn_gym/masks/natten.py): neighbourhood attention on a 16 x 16
canvas stored in Morton (Z-curve) order; the mask decodes coordinates with `&`, `|` and `>>`."""

import torch
from attn_gym.masks import generate_morton_natten

mask_mod = generate_morton_natten(canvas_w=16, canvas_h=16, kernel_w=5, kernel_h=5)
SHAPES = dict(B=1, H=4, S=16 * 16, D=64, dtype=torch.bfloat16)
