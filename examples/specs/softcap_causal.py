"""Gemma-2 style attention: logit soft-capping cap * tanh(s / cap) with cap = 50, causal.

q, k, v: [B, H, S, D] fp32; the causal mask is a float tril matrix compared with 0.
"""
import torch
import torch.nn as nn

B, H, S, D, CAP = 2, 4, 96, 64, 50.0


class Model(nn.Module):
    def __init__(self, softcap: float):
        super().__init__()
        self.softcap = softcap

    def forward(self, q, k, v):
        d = q.shape[-1]
        logits = torch.einsum("bhqd,bhkd->bhqk", q, k) * d ** -0.5
        logits = self.softcap * torch.tanh(logits / self.softcap)
        keep = torch.ones(q.shape[2], k.shape[2]).tril()
        logits = logits.masked_fill(keep == 0, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.einsum("bhqk,bhkd->bhqd", probs, v)


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)]


def get_init_inputs():
    return [CAP]
