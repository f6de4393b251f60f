"""Honest torch re-implementation of bf16_in_fp32_out_spec (torch-baseline mode): fp32 math and output, bf16 gradients."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
        return torch.matmul(torch.softmax(s, -1), v.float())
