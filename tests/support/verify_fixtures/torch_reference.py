"""Honest plain-torch re-implementation: passes only in torch-baseline mode (it uses matmul/softmax)."""

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # GQA: repeat KV heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
        if self.causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        return torch.matmul(torch.softmax(s, -1), v.float()).to(q.dtype)
