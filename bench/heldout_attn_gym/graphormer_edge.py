"""attention-gym `generate_graphormer_edge_bias` (attn_gym/mods/graphormer.py): Graphormer's edge encoding,
the mean over the first 3 edges of each shortest path of a per-(head, position, edge type) bias
(`edge_bias` [H, 3, 5]); path edge types and lengths from `shortest_path_edge_types` of random graphs."""

import torch
from attn_gym.mods import generate_graphormer_edge_bias, shortest_path_edge_types

B, H, NODES, MAX_PATH, EDGE_TYPES = 2, 4, 80, 3, 5
_g = torch.Generator().manual_seed(0)
ADJACENCY = torch.rand(B, NODES, NODES, generator=_g) < 0.05
ADJACENCY = ADJACENCY | ADJACENCY.transpose(1, 2)
TYPES = torch.randint(0, EDGE_TYPES, (B, NODES, NODES), generator=_g)
EDGE_BIAS = torch.randn(H, MAX_PATH, EDGE_TYPES, generator=_g)
score_mod = generate_graphormer_edge_bias(EDGE_BIAS, *shortest_path_edge_types(ADJACENCY, TYPES, MAX_PATH))
SHAPES = dict(B=B, H=H, S=NODES, D=64, dtype=torch.bfloat16)
