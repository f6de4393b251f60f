"""Packed varlen prefill written as a Python loop over the sequences (not supported: one attention
over the packed tokens with a block-diagonal mask from cu_seqlens is; see varlen_prefill_causal.py)."""
import torch
import torch.nn as nn

SEQ_LENS = (24, 9, 31)
T, H, D = sum(SEQ_LENS), 2, 32


class Model(nn.Module):
    def forward(self, q, k, v, cu_seqlens):
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens) - 1):
            a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            s = q[a:b].transpose(0, 1) @ k[a:b].permute(1, 2, 0) / D ** 0.5
            out[a:b] = (torch.softmax(s, dim=-1) @ v[a:b].transpose(0, 1)).transpose(0, 1)
        return out


def get_inputs():
    cu_seqlens = torch.tensor([0, *torch.tensor(SEQ_LENS).cumsum(0).tolist()], dtype=torch.int32)
    return [torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(T, H, D), cu_seqlens]


def get_init_inputs():
    return []
