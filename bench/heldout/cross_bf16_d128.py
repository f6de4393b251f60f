"""Cross attention, 4K decoder queries over 8K encoder keys, no mask, bf16, D=128.

Variant: M != N, every query sees every key. Plain F.softmax over scaled scores, fp32
math from bf16 inputs, bf16 output.
Small shape (CPU check): B=2, H=2, M=90, N=201, D=128, bf16.
Bench shape (H200, bf16): B=4, H=16, M=4096, N=8192, D=128.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

BENCH = dict(B=4, Hq=16, Hkv=16, M=4096, N=8192, D=128)
SDPA = "none"


class Model(nn.Module):
    def forward(self, x_q, mem_k, mem_v):
        scores = torch.matmul(x_q.float(), mem_k.float().transpose(-1, -2)) * x_q.shape[-1] ** -0.5
        return torch.matmul(F.softmax(scores, dim=-1), mem_v.float()).to(x_q.dtype)


def get_inputs():
    return [torch.randn(2, 2, 90, 128, dtype=torch.bfloat16),
            torch.randn(2, 2, 201, 128, dtype=torch.bfloat16),
            torch.randn(2, 2, 201, 128, dtype=torch.bfloat16)]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, H, M, N, D = BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["N"], BENCH["D"]
    return [torch.randn(B, H, M, D, dtype=torch.bfloat16, device=device),
            torch.randn(B, H, N, D, dtype=torch.bfloat16, device=device),
            torch.randn(B, H, N, D, dtype=torch.bfloat16, device=device)]


def flex_mods(*inputs):
    return None, None
