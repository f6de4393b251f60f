"""Tuning spec (not held out): causal document masking with the doc ids as one [S] tensor shared by the batch, bf16."""
import math

import torch
import torch.nn as nn

B, H, S, D = 2, 2, 220, 64
BENCH = [dict(B=4, Hq=16, Hkv=16, M=8192, N=8192, D=128)]
SDPA = None


class Model(nn.Module):
    def forward(self, q, k, v, doc):
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(k.shape[2])[None, :]
        same = doc[:, None] == doc[None, :]
        s = s.masked_fill(~same | (j > i), float("-inf"))
        return (s.softmax(-1) @ v.float()).to(q.dtype)


def _docs(n, device="cpu"):
    """Uneven documents shared by the batch: ids ascending along the sequence."""
    g = torch.Generator().manual_seed(7)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[: max(1, n // 600)] + 1).values
    ids = torch.zeros(n, dtype=torch.int32)
    ids[cuts] = 1
    return ids.cumsum(0).to(torch.int32).to(device)


def get_inputs():
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(3)] + [_docs(S)]


def get_init_inputs():
    return []


def bench_inputs(device, shape):
    g = lambda h, n: torch.randn(shape["B"], h, n, shape["D"], device=device, dtype=torch.bfloat16)  # noqa: E731
    return [g(shape["Hq"], shape["M"]), g(shape["Hkv"], shape["N"]), g(shape["Hkv"], shape["N"]), _docs(shape["N"], device)]


def flex_mods(q, k, v, doc):
    return None, lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
