"""attention-gym `generate_tanh_softcap` (attn_gym/mods/softcapping.py): Gemma-2 style logit softcap 20."""

import torch
from attn_gym.mods import generate_tanh_softcap

score_mod = generate_tanh_softcap(soft_cap=20)
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.bfloat16)
