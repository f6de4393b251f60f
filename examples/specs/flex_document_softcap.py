"""FlexAttention style: causal document masking over packed sequences plus tanh
soft-capping of the logits (cap 30). DOC_IDS: [B, S] tensor captured by mask_mod."""
import torch

SHAPES = dict(B=2, Hq=4, Hkv=4, M=128, N=128, D=64, dtype="fp32")
DOC_IDS = torch.stack([
    torch.repeat_interleave(torch.arange(3), torch.tensor([50, 30, 48])),
    torch.repeat_interleave(torch.arange(2), torch.tensor([100, 28])),
])
CAP = 30.0


def score_mod(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


def mask_mod(b, h, q_idx, kv_idx):
    return (DOC_IDS[b, q_idx] == DOC_IDS[b, kv_idx]) & (q_idx >= kv_idx)
