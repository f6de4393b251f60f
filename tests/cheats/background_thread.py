"""Cheat: returns at once and fills the output from a background thread (escapes the timer)."""
import threading

import torch
import torch.nn as nn
from _torch_attention import attention


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        out = torch.empty_like(q)
        worker = threading.Thread(target=lambda: out.copy_(attention(q, k, v, self.causal)))
        worker.start()
        worker.join()  # even finishing before returning is caught: the thread itself is the tell
        return out
