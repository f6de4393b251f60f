"""Varlen-style document causal attention from sequence offsets (cu_seqlens), bf16, D=128.

Variant: one packed row (B=1) of documents given by int32 offsets [n_docs + 1] (0, end of
doc 0, ..., S), as varlen APIs take them; query i sees key j iff both lie in the same
document and j <= i. The Model turns the offsets into per-position document ids with
torch.searchsorted, then builds an additive 0 / -inf bias. fp32 math, bf16 output.
Small shape (CPU check): B=1, H=2, S=260, D=128, bf16; documents of lengths (64, 90, 17, 89).
Bench shape (H200, bf16): B=1, H=16, S=16384, D=128; 12 documents of random length.
"""
import torch
import torch.nn as nn

BENCH = dict(B=1, Hq=16, Hkv=16, M=16384, N=16384, D=128)
SDPA = None


def offsets_for(lengths) -> torch.Tensor:
    return torch.cumsum(torch.tensor([0] + list(lengths)), 0).to(torch.int32)


class Model(nn.Module):
    def forward(self, q, k, v, cu_seqlens):
        S = q.shape[2]
        pos = torch.arange(S, device=q.device, dtype=torch.int32)
        doc = torch.searchsorted(cu_seqlens, pos, right=True) - 1                # [S]
        ok = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
        bias = torch.zeros(S, S, device=q.device).masked_fill(~ok, float("-inf"))
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5 + bias
        return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def get_inputs():
    q, k, v = (torch.randn(1, 2, 260, 128, dtype=torch.bfloat16) for _ in range(3))
    return [q, k, v, offsets_for([64, 90, 17, 89])]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, H, S, D = BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"]
    gen = torch.Generator().manual_seed(5)
    cuts = torch.sort(torch.randperm(S - 1, generator=gen)[:11] + 1).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([S])]).to(torch.int32)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16, device=device) for _ in range(3))
    return [q, k, v, offsets.to(device)]


def flex_mods(*inputs):
    q, offsets = inputs[0], inputs[3]
    pos = torch.arange(q.shape[2], device=q.device, dtype=torch.int32)
    doc = torch.searchsorted(offsets, pos, right=True) - 1   # built once, as FlexAttention users do

    def varlen_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    return None, varlen_causal
