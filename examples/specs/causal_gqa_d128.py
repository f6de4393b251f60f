"""Causal grouped-query attention (Llama style): 8 query heads share 2 kv heads.

q: [B, 8, S, 128], k, v: [B, 2, S, 128] fp32. kv heads are repeated with
repeat_interleave, so query head h reads kv head h // 4.
"""
import torch
import torch.nn as nn

B, HQ, HKV, S, D = 2, 8, 2, 64, 128


class Model(nn.Module):
    def __init__(self, n_rep: int):
        super().__init__()
        self.n_rep = n_rep

    def forward(self, q, k, v):
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        scores = q @ k.transpose(2, 3) * q.shape[-1] ** -0.5
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(k.shape[2])[None, :]
        scores = torch.where(i >= j, scores, float("-inf"))
        return scores.softmax(dim=-1) @ v


def get_inputs():
    return [torch.randn(B, HQ, S, D), torch.randn(B, HKV, S, D), torch.randn(B, HKV, S, D)]


def get_init_inputs():
    return [HQ // HKV]
