"""attention-gym `generate_alibi_bias` (attn_gym/mods/alibi.py): ALiBi, slope 2^(-8(h+1)/H) per head,
bidirectional."""

import torch
from attn_gym.mods import generate_alibi_bias

score_mod = generate_alibi_bias(H=4)
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.bfloat16)
