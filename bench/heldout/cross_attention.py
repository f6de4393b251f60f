"""Encoder-decoder cross attention (M != N, no mask), bf16 inputs, **fp32 output**, D=64.

Variant: queries from the decoder attend to all encoder keys; no mask, default scale,
written with torch.einsum. This is the one held-out spec that deliberately returns fp32
from bf16 inputs (the probabilities and the output stay in fp32; no cast back).
Small shape (CPU check): B=2, H=4, M=150, N=230, D=64; bf16 in, fp32 out.
Bench shape (H200, bf16 inputs): B=8, H=16, M=4096, N=8192, D=64.
"""
import math

import torch
import torch.nn as nn

BENCH = dict(B=8, Hq=16, Hkv=16, M=4096, N=8192, D=64)
SDPA = "none"


class Model(nn.Module):
    def __init__(self, dim_head=64):
        super().__init__()
        self.inv_sqrt_d = 1.0 / math.sqrt(dim_head)

    def forward(self, dec_q, enc_k, enc_v):
        sim = torch.einsum("bhid,bhjd->bhij", dec_q.float(), enc_k.float()) * self.inv_sqrt_d
        attn = sim.softmax(dim=-1)
        return torch.einsum("bhij,bhjd->bhid", attn, enc_v.float())


def get_inputs():
    dec = torch.randn(2, 4, 150, 64, dtype=torch.bfloat16)
    enc_k = torch.randn(2, 4, 230, 64, dtype=torch.bfloat16)
    enc_v = torch.randn(2, 4, 230, 64, dtype=torch.bfloat16)
    return [dec, enc_k, enc_v]


def get_init_inputs():
    return [64]


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, H, M, N, D = BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["N"], BENCH["D"]
    return [torch.randn(B, H, M, D, dtype=torch.bfloat16, device=device),
            torch.randn(B, H, N, D, dtype=torch.bfloat16, device=device),
            torch.randn(B, H, N, D, dtype=torch.bfloat16, device=device)]


def flex_mods(*inputs):
    return None, None
