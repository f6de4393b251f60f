"""Relative-position bias attention (T5 without buckets / Shaw et al.), bf16, D=64.

Variant: bidirectional; score = q k^T (T5 applies NO 1/sqrt(D) scaling, so SCALE = 1.0)
plus pos_bias[h, i - j + max_len - 1], a learned-looking table held as a registered
buffer [H, 2 * max_len - 1] (deterministic: a per-head log-distance decay, asymmetric
between past and future, plus noise). fp32 math from bf16 inputs, bf16 output.
q and k are drawn with std 0.4 so the scores and the bias are of similar size.
Small shape (CPU check): B=2, H=4, S=144, D=64, bf16; Model(4, 144).
Bench shape (H200, bf16): B=8, H=16, S=4096, D=64; Model(*bench_init_inputs()) = Model(16, 4096).
flex_mods(*inputs, model=...) reads the bias from the Model instance (or rebuilds the
same table from the input shape when no model is given).
"""
import torch
import torch.nn as nn

SCALE = 1.0
BENCH = dict(B=8, Hq=16, Hkv=16, M=4096, N=4096, D=64)
SDPA = None


def make_bias_table(n_heads: int, max_len: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(31337)
    dist = torch.arange(-(max_len - 1), max_len, dtype=torch.float32)      # i - j
    decay = torch.linspace(0.2, 1.5, n_heads).unsqueeze(1)
    future_penalty = 0.3 * (dist < 0).float()                                 # keys after the query
    table = -decay * torch.log1p(dist.abs()) - future_penalty
    return table + 0.1 * torch.randn(n_heads, 2 * max_len - 1, generator=gen)


class Model(nn.Module):
    def __init__(self, num_heads, max_len):
        super().__init__()
        self.max_len = max_len
        self.register_buffer("pos_bias", make_bias_table(num_heads, max_len))

    def forward(self, q, k, v):
        n = q.shape[2]
        ar = torch.arange(n, device=q.device)
        rel_idx = ar[:, None] - ar[None, :] + (self.max_len - 1)
        bias = self.pos_bias[:, rel_idx]                                        # [H, n, n]
        logits = torch.matmul(q.float(), k.float().transpose(-2, -1)) + bias.unsqueeze(0)
        attn = torch.softmax(logits, dim=-1)
        return torch.matmul(attn, v.float()).to(v.dtype)


def get_inputs():
    q = (0.4 * torch.randn(2, 4, 144, 64)).bfloat16()
    k = (0.4 * torch.randn(2, 4, 144, 64)).bfloat16()
    v = torch.randn(2, 4, 144, 64).bfloat16()
    return [q, k, v]


def get_init_inputs():
    return [4, 144]


def bench_init_inputs():
    return [BENCH["Hq"], BENCH["M"]]


def bench_inputs(device: str) -> list[torch.Tensor]:
    shape = (BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"])
    q = (0.4 * torch.randn(shape, device=device)).bfloat16()
    k = (0.4 * torch.randn(shape, device=device)).bfloat16()
    v = torch.randn(shape, device=device).bfloat16()
    return [q, k, v]


def flex_mods(*inputs, model=None):
    q = inputs[0]
    if model is None:
        model = Model(q.shape[1], q.shape[2])
    table = model.pos_bias.to(q.device)
    offset = model.max_len - 1

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + offset]

    return rel_bias, None
