"""Cheat: SDPA inside a `torch.library.custom_op` (reached through getattr, past the static scan), so the call the
harness's dispatch mode sees is one operator whose body it must look into."""
import torch
import torch.nn as nn
import torch.nn.functional as F

_SDPA = getattr(F, "scaled_" + "dot_product_attention")

@torch.library.custom_op("cheat_kb::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return _SDPA(q, k, v, is_causal=causal)


@_attention.register_fake
def _(q, k, v, causal):
    return torch.empty_like(q)


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return _attention(q, k, v, self.causal)
