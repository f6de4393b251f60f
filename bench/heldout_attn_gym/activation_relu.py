"""attention-gym `generate_activation_score_mod(F.relu)` (attn_gym/mods/activation.py): softmax replaced by
ReLU through score_mod(s) = log(relu(s) + 1)."""

import torch
import torch.nn.functional as F
from attn_gym.mods import generate_activation_score_mod

score_mod = generate_activation_score_mod(F.relu, offset=1.0)
SHAPES = dict(B=2, H=4, S=200, D=64, dtype=torch.float32)
