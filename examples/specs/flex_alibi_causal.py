"""FlexAttention style: ALiBi score_mod and a causal mask_mod (see docs/specs.md)."""
import torch

H = 8
SLOPES = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)])
SHAPES = dict(B=2, Hq=H, Hkv=H, M=128, N=128, D=64, dtype="fp32")


def score_mod(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
