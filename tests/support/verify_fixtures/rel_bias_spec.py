"""Spec with a learnable parameter: attention plus a relative-position bias table (T5/ALiBi-like, learned).

scores[b, h, i, j] = q_i . k_j / sqrt(D) + rel_bias[h, i - j + MAX_LEN - 1]; the table's gradient is the
sum of dS over each diagonal. A candidate must hold the table under the same name (`rel_bias`).
"""

import torch
import torch.nn as nn

MAX_LEN = 160  # longer than any length the harness plans (129)


class Model(nn.Module):
    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.rel_bias = nn.Parameter(0.5 * torch.randn(heads, 2 * MAX_LEN - 1))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rel = torch.arange(q.shape[-2], device=q.device)[:, None] - torch.arange(k.shape[-2], device=q.device)[None, :]
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + self.rel_bias[:, rel + MAX_LEN - 1]
        return torch.softmax(scores, dim=-1) @ v


def get_inputs():
    return [torch.randn(1, 2, 24, 16) for _ in range(3)]


def get_init_inputs():
    return [2]
