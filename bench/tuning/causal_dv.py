"""Tuning spec (not held out): causal self-attention whose value heads differ in width from the query/key
heads (MLA-style, D_v != D_qk), bf16. Timed at D=192/Dv=128 (DeepSeek-style MLA) and D=64/Dv=128."""
import math

import torch
import torch.nn as nn

B, H, S, D, DV = 2, 2, 192, 64, 128
BENCH = [dict(B=4, Hq=16, Hkv=16, M=4096, N=4096, D=192, Dv=128), dict(B=8, Hq=16, Hkv=16, M=4096, N=4096, D=64, Dv=128)]
SDPA = "causal"


class Model(nn.Module):
    def forward(self, q, k, v):
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return (s.softmax(-1) @ v.float()).to(q.dtype)


def get_inputs():
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16), torch.randn(B, H, S, D, dtype=torch.bfloat16),
            torch.randn(B, H, S, DV, dtype=torch.bfloat16)]


def get_init_inputs():
    return []


def bench_inputs(device, shape):
    g = lambda h, n, d: torch.randn(shape["B"], h, n, d, device=device, dtype=torch.bfloat16)  # noqa: E731
    dv = shape.get("Dv", shape["D"])
    return [g(shape["Hq"], shape["M"], shape["D"]), g(shape["Hkv"], shape["N"], shape["D"]), g(shape["Hkv"], shape["N"], dv)]


def flex_mods(*inputs):
    return None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
