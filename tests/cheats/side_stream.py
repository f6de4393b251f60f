"""Cheat (GPU): launches the work on a side stream and returns before it finishes, escaping a timer
that only records events on the default stream."""
import torch
import torch.nn as nn
from _torch_attention import attention


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal
        self.stream = torch.cuda.Stream()

    def forward(self, q, k, v):
        out = torch.empty_like(q)
        with torch.cuda.stream(self.stream):
            out.copy_(attention(q, k, v, self.causal))
        return out
