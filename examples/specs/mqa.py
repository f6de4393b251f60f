"""Multi-query attention (PaLM / Falcon): all 8 query heads share one kv head; kv is
broadcast with unsqueeze + expand + reshape. Bidirectional. q: [B, 8, S, D], k, v: [B, 1, S, D]."""
import torch
import torch.nn as nn

B, HQ, S, D = 2, 8, 96, 64


class Model(nn.Module):
    def forward(self, q, k, v):
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        k = k[:, :, None].expand(b, hkv, hq // hkv, s, d).reshape(b, hq, s, d)
        v = v[:, :, None].expand(b, hkv, hq // hkv, s, d).reshape(b, hq, s, d)
        q = q * d ** -0.5
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, S, D), torch.randn(B, 1, S, D), torch.randn(B, 1, S, D)]


def get_init_inputs():
    return []
