"""attention-gym `generate_sandwich_bias` (attn_gym/mods/sandwich.py): Sandwich relative bias, a cosine table
over distances (`rel_bias` for sequences up to 256) scaled per head."""

import torch
from attn_gym.mods import generate_sandwich_bias

score_mod = generate_sandwich_bias(H=4, max_seq_len=256, d_bar=128)
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.bfloat16)
