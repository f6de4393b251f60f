"""A learnable relative-position bias table, zero-initialised (as T5/Shaw models start),
gathered by q_idx - kv_idx, inside a submodule, under a causal mask buffer. The kernel must
read `attn.rel_bias` at run time."""
import math

import torch
import torch.nn as nn

B, H, S, D = 1, 2, 32, 16


class Bias(nn.Module):
    def __init__(self, n_heads, seq):
        super().__init__()
        self.rel_bias = nn.Parameter(torch.zeros(n_heads, 2 * seq - 1))
        self.register_buffer("causal", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))


class Model(nn.Module):
    def __init__(self, n_heads, seq):
        super().__init__()
        self.attn = Bias(n_heads, seq)

    def forward(self, q, k, v):
        n = q.shape[2]
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        idx = torch.arange(n)[:, None] - torch.arange(n)[None, :] + n - 1
        s = s + self.attn.rel_bias[:, idx].unsqueeze(0)
        s = s.masked_fill(~self.attn.causal[:n, :n], float("-inf"))
        return torch.softmax(s, dim=-1) @ v


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)]


def get_init_inputs():
    return [H, S]
