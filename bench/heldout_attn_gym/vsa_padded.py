"""attention-gym `generate_vsa_mask_mod` with `variable_block_sizes` (attn_gym/masks/vsa.py): VSA's fine pass
over 4 KV tiles of 64 slots whose last one holds 40 real tokens; 3 top-k tiles per query tile."""

import torch
from attn_gym.masks import generate_vsa_mask_mod

B, H, TILE, TILES, TOP_K = 1, 4, 64, 4, 3
TOPK = torch.rand(B, H, TILES, TILES, generator=torch.Generator().manual_seed(1)).topk(TOP_K).indices.int()
SIZES = torch.tensor([64, 64, 64, 40], dtype=torch.int32)
mask_mod = generate_vsa_mask_mod(TOPK, tile_numel=TILE, variable_block_sizes=SIZES)
SHAPES = dict(B=B, H=H, S=TILES * TILE, D=64, dtype=torch.bfloat16)
