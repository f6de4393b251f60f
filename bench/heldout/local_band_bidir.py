"""Bidirectional local (banded) attention, Longformer-style: |i - j| <= 48, fp32.

Variant: symmetric sliding window of radius 48 (97 keys wide, not a power of two),
held as a boolean band-mask buffer sized by the constructor's max_len and sliced to the
sequence length; masked with the fp32 finfo.min fill. fp32 in, fp32 out.
Small shape (CPU check): B=2, H=4, S=161, D=64, fp32 (buffer for max_len=161).
Bench shape (H200, bf16): B=8, H=16, S=4096, D=64 (bench_init_inputs: max_len=4096).
"""
import math

import torch
import torch.nn as nn

RADIUS = 48
SMALL = dict(B=2, H=4, S=161, D=64)

BENCH = dict(B=8, Hq=16, Hkv=16, M=4096, N=4096, D=64)
SDPA = None


class Model(nn.Module):
    def __init__(self, max_len, radius=RADIUS):
        super().__init__()
        pos = torch.arange(max_len)
        band = (pos[:, None] - pos[None, :]).abs() <= radius
        self.register_buffer("band", band, persistent=False)

    def forward(self, x_q, x_k, x_v):
        n = x_q.size(2)
        sim = torch.einsum("bhid,bhjd->bhij", x_q, x_k) / math.sqrt(x_q.size(-1))
        sim = sim.masked_fill(~self.band[:n, :n], torch.finfo(sim.dtype).min)
        return torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), x_v)


def get_inputs():
    s = SMALL
    return [torch.randn(s["B"], s["H"], s["S"], s["D"]) for _ in range(3)]


def get_init_inputs():
    return [SMALL["S"], RADIUS]


def bench_init_inputs():
    return [BENCH["M"], RADIUS]


def bench_inputs(device: str) -> list[torch.Tensor]:
    return [torch.randn(BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"], device=device, dtype=torch.bfloat16)
            for _ in range(3)]


def flex_mods(*inputs):
    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= RADIUS

    return None, band
