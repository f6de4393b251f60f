"""Shared honest torch math for the cheats (so each cheat differs from honest only by its hack).

The file name starts with '_' so the catalogue test does not treat it as a cheat.
"""

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) / q.shape[-1] ** 0.5
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
