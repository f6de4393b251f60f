"""Spec: attention with a learned sink logit per head (gpt-oss style), fp32. The sinks start at zero, where they barely
change the output of 64 keys: only a call with the parameters redrawn tells a kernel that ignores them."""

import torch
import torch.nn as nn

H = 2


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.full((H,), -6.0))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        sink = self.sinks[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
        return torch.cat([s, sink], dim=-1).softmax(dim=-1)[..., :-1] @ v


def get_inputs():
    return [torch.randn(2, H, 64, 32) for _ in range(3)]


def get_init_inputs():
    return []
