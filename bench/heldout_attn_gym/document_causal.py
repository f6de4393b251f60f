"""attention-gym `generate_doc_mask_mod(causal_mask, offsets)` (attn_gym/masks/document_mask.py): four packed
documents of 50, 80, 40 and 67 tokens, causal inside each. The closure reads `document_id` and `offsets`,
tensors whose length is fixed by the documents: the spec's sequence length is 237."""

import torch
from attn_gym.masks import causal_mask, generate_doc_mask_mod
from attn_gym.masks.document_mask import length_to_offsets

LENGTHS = [50, 80, 40, 67]
mask_mod = generate_doc_mask_mod(causal_mask, length_to_offsets(LENGTHS, "cpu"))
SHAPES = dict(B=2, H=4, S=sum(LENGTHS), D=64, dtype=torch.bfloat16)
