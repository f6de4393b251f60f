"""Cheat: matmul + softmax behind an operator defined with torch.library.Library and a plain kernel registration,
which no Python custom_op registry records: the harness cannot look inside, so it must refuse it (the torch ops are
reached through getattr, past the static scan)."""
import torch
import torch.nn as nn

_LIB = torch.library.Library("cheat_kb_opaque", "DEF")
_LIB.define("attention(Tensor q, Tensor k, Tensor v) -> Tensor")


_MM, _SOFTMAX = getattr(torch, "mat" + "mul"), getattr(torch, "soft" + "max")


def _attention(q, k, v):
    return _MM(_SOFTMAX(_MM(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1), v)


_LIB.impl("attention", _attention, "CompositeExplicitAutograd")


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return torch.ops.cheat_kb_opaque.attention(q, k, v)
