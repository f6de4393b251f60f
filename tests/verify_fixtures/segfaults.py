"""A candidate that crashes the process (reads address 0), like a kernel with a bad pointer."""
import ctypes

import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()

    def forward(self, q, k, v):
        return ctypes.string_at(0, 8)
