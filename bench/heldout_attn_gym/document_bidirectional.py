"""attention-gym `generate_doc_mask_mod(noop_mask, offsets)` (attn_gym/masks/document_mask.py): packed
documents of 64, 30, 90 and 33 tokens, every token sees its whole document (FlexAttention's `noop_mask`
inside each document)."""

import torch
from attn_gym.masks import generate_doc_mask_mod
from attn_gym.masks.document_mask import length_to_offsets
from torch.nn.attention.flex_attention import noop_mask

LENGTHS = [64, 30, 90, 33]
mask_mod = generate_doc_mask_mod(noop_mask, length_to_offsets(LENGTHS, "cpu"))
SHAPES = dict(B=2, H=4, S=sum(LENGTHS), D=64, dtype=torch.bfloat16)
