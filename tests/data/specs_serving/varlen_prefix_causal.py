"""Packed varlen prefill over cached prefixes (flash_attn_varlen form): each sequence has more keys than queries
(len_k = len_q + a cached prefix), causal aligned bottom-right (query i of a sequence sees keys j <= i + len_k - len_q),
GQA 2:1, with a learned attention sink per query head (gpt-oss prefill), fp16. A test serving spec (the held-out ones
are in bench/heldout_serving)."""
import torch
import torch.nn as nn

HQ, HKV, D = 4, 2, 32
LENS_Q = (5, 0, 70, 33)
LENS_K = (40, 9, 70, 100)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.tensor([1.5, -0.5, 0.0, 3.0]))

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q):
        tq, tk, d = q.shape[0], k.shape[0], q.shape[-1]
        seq_q = torch.searchsorted(cu_seqlens_q, torch.arange(tq), right=True) - 1
        seq_k = torch.searchsorted(cu_seqlens_k, torch.arange(tk), right=True) - 1
        pos_q = torch.arange(tq) - cu_seqlens_q[seq_q]
        pos_k = torch.arange(tk) - cu_seqlens_k[seq_k]
        len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1])[seq_q]
        len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1])[seq_q]
        allowed = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= (pos_q + len_k - len_q)[:, None])
        kk = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(0, 1)
        vv = v.float().repeat_interleave(q.shape[1] // v.shape[1], dim=1).transpose(0, 1)
        s = (q.float().transpose(0, 1) @ kk.transpose(1, 2)) / d ** 0.5
        s = s.masked_fill(~allowed[None], float("-inf"))
        sink = self.sinks.float()[:, None, None].expand(-1, tq, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        return (p @ vv).transpose(0, 1).to(q.dtype)


def get_inputs():
    g = torch.Generator().manual_seed(4)
    cu_q = torch.tensor([0, *torch.tensor(LENS_Q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(LENS_K).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(LENS_Q), HQ, D, generator=g).to(torch.float16)
    k, v = (torch.randn(sum(LENS_K), HKV, D, generator=g).to(torch.float16) for _ in range(2))
    return [q, k, v, cu_q, cu_k, max(LENS_Q)]


def get_init_inputs():
    return []
