"""A candidate that never returns."""
import time

import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()

    def forward(self, q, k, v):
        while True:
            time.sleep(1)
