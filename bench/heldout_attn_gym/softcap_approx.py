"""attention-gym `generate_tanh_softcap(approx=True)` (attn_gym/mods/softcapping.py): softcap 20 through the
`approx::tanh` custom op (PTX `tanh.approx.f32` under torch.compile on a GPU, torch.tanh elsewhere)."""

import torch
from attn_gym.mods import generate_tanh_softcap

score_mod = generate_tanh_softcap(soft_cap=20, approx=True)
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.bfloat16)
