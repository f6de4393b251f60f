"""attention-gym `generate_tiled_natten` (attn_gym/masks/natten.py): neighbourhood attention on a 16 x 12
canvas stored in 4 x 4 tiles, a 5 x 5 kernel."""

import torch
from attn_gym.masks import generate_tiled_natten

mask_mod = generate_tiled_natten(W=16, H=12, K_W=5, K_H=5, T_W=4, T_H=4)
SHAPES = dict(B=1, H=4, S=16 * 12, D=64, dtype=torch.bfloat16)
