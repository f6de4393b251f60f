"""attention-gym `generate_mla_rope_score_mod` (attn_gym/mods/latent_attention.py): DeepSeek-V2 MLA's
decoupled RoPE term, score + torch.dot(query_rope[b, h, q_idx], key_rope[b, 0, kv_idx]) over DeepSeek-V2's
64-wide rope dim (the positional parts are [B, H, S, 64] and [B, 1, S, 64] tensors)."""

import torch
from attn_gym.mods import generate_mla_rope_score_mod

B, H, S, ROPE = 2, 4, 128, 64
_g = torch.Generator().manual_seed(0)
QUERY_ROPE = torch.randn(B, H, S, ROPE, generator=_g) * 0.125
KEY_ROPE = torch.randn(B, 1, S, ROPE, generator=_g) * 0.125
score_mod = generate_mla_rope_score_mod(QUERY_ROPE, KEY_ROPE, num_heads=H, scale=1.0)
SHAPES = dict(B=B, H=H, S=S, D=64, dtype=torch.bfloat16)
