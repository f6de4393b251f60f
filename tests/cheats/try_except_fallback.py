"""Cheat: a 'kernel' that fails on ragged shapes and silently falls back to the reference."""
import torch.nn as nn
from attn_spec import Model


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        try:
            raise NotImplementedError("my kernel only supports multiples of 64")
        except NotImplementedError:
            return Model(self.causal)(q, k, v)
