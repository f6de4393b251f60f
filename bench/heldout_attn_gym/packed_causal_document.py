"""attention-gym `generate_packed_causal_doc_mask_mod` (attn_gym/masks/document_mask.py): causal packed
documents of 70, 45, 61 and 55 tokens, each query row one contiguous KV interval."""

import torch
from attn_gym.masks import generate_packed_causal_doc_mask_mod
from attn_gym.masks.document_mask import length_to_offsets

LENGTHS = [70, 45, 61, 55]
mask_mod = generate_packed_causal_doc_mask_mod(length_to_offsets(LENGTHS, "cpu"))
SHAPES = dict(B=2, H=4, S=sum(LENGTHS), D=128, dtype=torch.bfloat16)
