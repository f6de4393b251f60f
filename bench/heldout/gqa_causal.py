"""Grouped-query causal attention (LLaMA-2/3 70B style: 32 query heads over 8 KV heads), bf16, D=128.

Variant: causal, GQA with group size Hq / Hkv; query head h reads KV head h // group
(KV heads broadcast with [:, :, None].expand(...).reshape(...)). Mask built with
torch.where on an index comparison. fp32 math from bf16 inputs, bf16 output.
Small shape (CPU check): B=2, Hq=4, Hkv=2, S=192, D=128, bf16.
Bench shape (H200, bf16): B=4, Hq=32, Hkv=8, S=8192, D=128.
"""
import math

import torch
import torch.nn as nn

N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 128

BENCH = dict(B=4, Hq=32, Hkv=8, M=8192, N=8192, D=128)
SDPA = "causal"


def expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, n_kv, slen, hd = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(bs, n_kv, n_rep, slen, hd).reshape(bs, n_kv * n_rep, slen, hd)


class Model(nn.Module):
    def __init__(self, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS):
        super().__init__()
        self.n_rep = n_heads // n_kv_heads

    def forward(self, xq, xk, xv):
        keys = expand_kv(xk, self.n_rep).float()
        values = expand_kv(xv, self.n_rep).float()
        seqlen = xq.shape[2]
        scores = torch.matmul(xq.float(), keys.transpose(2, 3)) / math.sqrt(xq.shape[-1])
        idx = torch.arange(seqlen, device=xq.device)
        causal = idx[None, :] <= idx[:, None]
        scores = torch.where(causal, scores, float("-inf"))
        scores = torch.softmax(scores, dim=-1)
        return torch.matmul(scores, values).type_as(xq)


def get_inputs():
    bsz, seqlen = 2, 192
    return [torch.randn(bsz, N_HEADS, seqlen, HEAD_DIM, dtype=torch.bfloat16),
            torch.randn(bsz, N_KV_HEADS, seqlen, HEAD_DIM, dtype=torch.bfloat16),
            torch.randn(bsz, N_KV_HEADS, seqlen, HEAD_DIM, dtype=torch.bfloat16)]


def get_init_inputs():
    return [N_HEADS, N_KV_HEADS]


def bench_init_inputs():
    return [BENCH["Hq"], BENCH["Hkv"]]


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, S, D = BENCH["B"], BENCH["M"], BENCH["D"]
    return [torch.randn(B, BENCH["Hq"], S, D, dtype=torch.bfloat16, device=device),
            torch.randn(B, BENCH["Hkv"], S, D, dtype=torch.bfloat16, device=device),
            torch.randn(B, BENCH["Hkv"], S, D, dtype=torch.bfloat16, device=device)]


def flex_mods(*inputs):
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return None, causal
