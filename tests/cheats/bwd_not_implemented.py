"""Backward cheat: an autograd.Function with a forward only (torch raises when backward is asked for)."""
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support" / "verify_fixtures"))
from triton_flash_bwd import flash_forward


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        return flash_forward(q, k, v, causal)[0]


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return _Attention.apply(q, k, v, self.causal)

