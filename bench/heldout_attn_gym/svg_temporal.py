"""attention-gym `generate_temporal_head_mask_mod` (attn_gym/masks/svg.py): Sparse VideoGen's temporal head,
a 16-token prompt and 4 frames of 48 tokens; tokens at nearby positions of every frame."""

import torch
from attn_gym.masks import generate_temporal_head_mask_mod

mask_mod = generate_temporal_head_mask_mod(prompt_length=16, num_frames=4, token_per_frame=48, width=2)
SHAPES = dict(B=1, H=4, S=16 + 4 * 48, D=64, dtype=torch.bfloat16)
