"""ALiBi (Press et al.) causal attention with per-head geometric slopes, bf16, D=128.

Variant: score + slope[h] * (j - i) on the scaled scores, causal; the slopes
2^(-8 (h+1) / H) are a buffer built from the head count in the constructor. Causal
positions are filled with -1e9. fp32 math from bf16 inputs, bf16 output.
Small shape (CPU check): B=2, H=4, S=190, D=128, bf16 (slopes for 4 heads).
Bench shape (H200, bf16): B=4, H=16, S=8192, D=128 (bench_init_inputs: 16 heads).
"""
import math

import torch
import torch.nn as nn

BENCH = dict(B=4, Hq=16, Hkv=16, M=8192, N=8192, D=128)
SDPA = None


def alibi_slopes(n_heads: int) -> torch.Tensor:
    start = 2.0 ** (-8.0 / n_heads)
    return torch.tensor([start ** (i + 1) for i in range(n_heads)], dtype=torch.float32)


class Model(nn.Module):
    def __init__(self, n_heads):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads))

    def forward(self, q, k, v):
        seq_len = q.shape[2]
        pos = torch.arange(seq_len, device=q.device)
        rel = (pos[None, :] - pos[:, None]).float()          # j - i, <= 0 on the visible side
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = scores + self.slopes.view(1, -1, 1, 1) * rel
        scores = scores.masked_fill(rel > 0, -1e9)
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v.float()).to(q.dtype)


def get_inputs():
    B, H, S, D = 2, 4, 190, 128
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16),
            torch.randn(B, H, S, D, dtype=torch.bfloat16),
            torch.randn(B, H, S, D, dtype=torch.bfloat16)]


def get_init_inputs():
    return [4]


def bench_init_inputs():
    return [BENCH["Hq"]]


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, H, S, D = BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"]
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16, device=device) for _ in range(3)]


def flex_mods(*inputs):
    q = inputs[0]
    slopes = alibi_slopes(q.shape[1]).to(q.device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return alibi, causal
