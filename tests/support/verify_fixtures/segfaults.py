"""A candidate whose process dies of SIGSEGV, like a kernel launch with a bad pointer."""
import os
import signal

import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()

    def forward(self, q, k, v):
        os.kill(os.getpid(), signal.SIGSEGV)
