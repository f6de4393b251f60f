"""attention-gym `generate_vsa_mask_mod` (attn_gym/masks/vsa.py): Video Sparse Attention's fine pass, each
64-token query tile sees its 2 top-k KV tiles out of 4 (`topk_indices` [B, H, 4, 2], fixed here); the mask
tests membership with `(selected_tiles == kv_tile.unsqueeze(-1)).any(dim=-1)`."""

import torch
from attn_gym.masks import generate_vsa_mask_mod

B, H, TILE, TILES, TOP_K = 2, 4, 64, 4, 2
TOPK = torch.rand(B, H, TILES, TILES, generator=torch.Generator().manual_seed(0)).topk(TOP_K).indices.int()
mask_mod = generate_vsa_mask_mod(TOPK, tile_numel=TILE)
SHAPES = dict(B=B, H=H, S=TILES * TILE, D=64, dtype=torch.bfloat16)
