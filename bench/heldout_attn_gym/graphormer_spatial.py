"""attention-gym `generate_graphormer_spatial_bias` (attn_gym/mods/graphormer.py): Graphormer's spatial
encoding, a per-head bias per shortest-path distance (`spatial_bias` [H, 8]) read at
`distances[b, q_idx, kv_idx]` ([B, 96, 96] int32 from `shortest_path_distances` of two random graphs)."""

import torch
from attn_gym.mods import generate_graphormer_spatial_bias, shortest_path_distances

B, H, NODES, MAX_DISTANCE = 2, 4, 96, 6
_g = torch.Generator().manual_seed(0)
ADJACENCY = torch.rand(B, NODES, NODES, generator=_g) < 0.04
ADJACENCY = ADJACENCY | ADJACENCY.transpose(1, 2)
SPATIAL_BIAS = torch.randn(H, MAX_DISTANCE + 2, generator=_g)
score_mod = generate_graphormer_spatial_bias(SPATIAL_BIAS, shortest_path_distances(ADJACENCY, MAX_DISTANCE))
SHAPES = dict(B=B, H=H, S=NODES, D=64, dtype=torch.bfloat16)
