"""attention-gym `generate_vision_cross_attention_mask_mod` (attn_gym/masks/flamingo.py): Flamingo's
vision cross attention, 150 text queries over 3 images of 32 tokens (96 keys); text token i sees image n
when intervals[n, 0] <= i < intervals[n, 1]."""

import torch
from attn_gym.masks import generate_vision_cross_attention_mask_mod

INTERVALS = torch.tensor([[0, 60], [40, 110], [110, 150]])
mask_mod = generate_vision_cross_attention_mask_mod(INTERVALS, image_token_length=32)
SHAPES = dict(B=2, H=4, M=150, N=3 * 32, D=64, dtype=torch.bfloat16)
