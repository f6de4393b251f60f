"""attention-gym `generate_jetspec_training_mask_mod` (attn_gym/masks/jetspec.py): JetSpec's draft-head
training mask, 8 blocks of 16 queries over a 64-key prefix and the same blocks."""

import torch
from attn_gym.masks import generate_jetspec_training_mask_mod

mask_mod = generate_jetspec_training_mask_mod(prefix_length=64, block_size=16)
SHAPES = dict(B=2, H=4, M=8 * 16, N=64 + 8 * 16, D=64, dtype=torch.bfloat16)
