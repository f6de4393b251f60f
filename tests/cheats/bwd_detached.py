"""Backward cheat: a correct forward kernel launched outside autograd: the output has no grad_fn, so
a training step would silently get no gradients for q, k, v."""
import sys
from pathlib import Path

import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support" / "verify_fixtures"))
from triton_flash_bwd import flash_forward


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return flash_forward(q, k, v, self.causal)[0]
