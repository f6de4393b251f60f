"""Prefix-LM attention (T5/UniLM/PaLI style), fp32, D=64.

Variant: each batch row has a prefix of fixed length prefix_lens[b] (int64 [B] forward
input) that is attended bidirectionally; after the prefix, attention is causal:
key j is visible to query i iff j < prefix_lens[b] or j <= i. Built with torch.where.
fp32 in, fp32 out.
Small shape (CPU check): B=2, H=4, S=210, D=64, fp32; prefixes 70 and 133.
Bench shape (H200, bf16): B=8, H=16, S=4096, D=64; prefixes drawn in [S/8, S/2].
"""
import math

import torch
import torch.nn as nn

B, H, S, D = 2, 4, 210, 64
PREFIXES = [70, 133]

BENCH = dict(B=8, Hq=16, Hkv=16, M=4096, N=4096, D=64)
SDPA = None


class Model(nn.Module):
    def forward(self, q, k, v, prefix_lens):
        L = q.shape[-2]
        i = torch.arange(L, device=q.device).view(1, 1, L, 1)
        j = torch.arange(L, device=q.device).view(1, 1, 1, L)
        in_prefix = j < prefix_lens.view(-1, 1, 1, 1)
        visible = in_prefix | (j <= i)
        scores = q.matmul(k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = torch.where(visible, scores, torch.full_like(scores, float("-inf")))
        return scores.softmax(-1).matmul(v)


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D),
            torch.tensor(PREFIXES, dtype=torch.int64)]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    b, h, s, d = BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"]
    gen = torch.Generator().manual_seed(7)
    prefix_lens = torch.randint(s // 8, s // 2 + 1, (b,), generator=gen, dtype=torch.int64)
    qkv = [torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16) for _ in range(3)]
    return qkv + [prefix_lens.to(device)]


def flex_mods(*inputs):
    prefix_lens = inputs[3]

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_lens[b]) | (kv_idx <= q_idx)

    return None, prefix_lm_mask
