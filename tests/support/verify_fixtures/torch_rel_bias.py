"""Honest plain-torch candidate for rel_bias_spec (torch-baseline mode): the table is a parameter of the same name."""
import torch
import torch.nn as nn

MAX_LEN = 160


class ModelNew(nn.Module):
    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.rel_bias = nn.Parameter(torch.zeros(heads, 2 * MAX_LEN - 1))  # the harness copies Model's values in

    def forward(self, q, k, v):
        rel = torch.arange(q.shape[-2])[:, None] - torch.arange(k.shape[-2])[None, :] + MAX_LEN - 1
        s = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + self.rel_bias[:, rel]
        return torch.matmul(torch.softmax(s, -1), v)
