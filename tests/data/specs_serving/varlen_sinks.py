"""Packed varlen prefill (flash_attn_varlen form), causal within each sequence, with a learned attention sink per
query head (gpt-oss prefill), GQA 2:1, bf16; queries and keys share one offsets tensor, so the verifier's re-split
applies (tests/test_verify_serving_cases.py). A test serving spec (the held-out ones are in bench/heldout_serving)."""
import torch
import torch.nn as nn

HQ, HKV, D = 4, 2, 32
LENS = (21, 0, 50, 7)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.tensor([1.5, -0.5, 0.0, 3.0]))

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q):
        t, d = q.shape[0], q.shape[-1]
        seq = torch.searchsorted(cu_seqlens_q, torch.arange(t), right=True) - 1
        pos = torch.arange(t)
        allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
        kk = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(0, 1)
        vv = v.float().repeat_interleave(q.shape[1] // v.shape[1], dim=1).transpose(0, 1)
        s = (q.float().transpose(0, 1) @ kk.transpose(1, 2)) / d ** 0.5  # [Hq, T, T]
        s = s.masked_fill(~allowed[None], float("-inf"))
        sink = self.sinks.float()[:, None, None].expand(-1, t, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        return (p @ vv).transpose(0, 1).to(q.dtype)


def get_inputs():
    g = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(LENS), HQ, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(sum(LENS), HKV, D, generator=g).to(torch.bfloat16) for _ in range(2))
    return [q, k, v, cu, cu, max(LENS)]


def get_init_inputs():
    return []
