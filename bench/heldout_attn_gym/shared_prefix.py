"""attention-gym `generate_shared_prefix_mask_mod` (attn_gym/masks/shared_prefix.py): two prompts (40 and
30 tokens) each shared by continuations (25 + 35 and 20 + 45 + 21 tokens), packed; continuations see
their prompt and themselves causally."""

import torch
from attn_gym.masks import generate_shared_prefix_mask_mod
from attn_gym.masks.document_mask import length_to_offsets

LENGTHS = [40, 25, 35, 30, 20, 45, 21]
PREFIX_DOCUMENT_ID = torch.tensor([0, 0, 0, 3, 3, 3, 3])
mask_mod = generate_shared_prefix_mask_mod(length_to_offsets(LENGTHS, "cpu"), PREFIX_DOCUMENT_ID)
SHAPES = dict(B=2, H=4, S=sum(LENGTHS), D=64, dtype=torch.bfloat16)
