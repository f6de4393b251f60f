"""attention-gym `generate_activation_score_mod(F.gelu)` (attn_gym/mods/activation.py): softmax replaced by
GELU through score_mod(s) = log(gelu(s) + 1) (undo_softmax recovers gelu(S) @ V from the output and lse)."""

import torch
import torch.nn.functional as F
from attn_gym.mods import generate_activation_score_mod

score_mod = generate_activation_score_mod(F.gelu, offset=1.0)
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.float32)
