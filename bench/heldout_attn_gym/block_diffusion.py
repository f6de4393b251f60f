"""attention-gym `generate_block_diffusion_mask` (attn_gym/masks/block_diffusion.py): BD3-LM's training
mask over 100 noised then 100 clean tokens, blocks of 16."""

import torch
from attn_gym.masks import generate_block_diffusion_mask

mask_mod = generate_block_diffusion_mask(seq_len=100, block_size=16)
SHAPES = dict(B=2, H=4, S=2 * 100, D=64, dtype=torch.bfloat16)
