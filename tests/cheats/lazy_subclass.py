"""Cheat: returns a tensor subclass (a lazy result object) instead of a plain tensor."""
import torch
import torch.nn as nn
from _torch_attention import attention


class LazyResult(torch.Tensor):
    pass


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return attention(q, k, v, self.causal).as_subclass(LazyResult)
