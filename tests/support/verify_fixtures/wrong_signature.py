"""A candidate whose forward takes different parameters from the spec's Model."""
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()

    def forward(self, qkv):
        return qkv
