"""Tuning spec (not held out): packed varlen prefill in flash_attn_varlen's form, causal, GQA, bf16.

forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen): q [Tq, Hq, D], k, v [Tk, Hkv, D], the sequences packed one
after another; cu_seqlens_q / cu_seqlens_k [B + 1] int32 their offsets; max_seqlen the longest one. Query i of a
sequence sees its own sequence's keys up to the bottom-right-aligned diagonal. Returns [Tq, Hq, D] in q's dtype.
Written 2026-12-07 to measure serving designs on (`python -m bench.gpu.serving_tune`), apart from
bench/heldout_serving/.
"""
import torch
import torch.nn as nn

HQ, HKV, D = 4, 2, 64
SEQ_LENS = (21, 3, 70, 0, 33)
BENCH = dict(Hq=16, Hkv=4, D=128, SEQ_LENS=(2048, 6000, 700, 4096, 3000, 1500))


class Model(nn.Module):
    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen):
        tq, tk, d = q.shape[0], k.shape[0], q.shape[-1]
        seq_q = torch.searchsorted(cu_seqlens_q, torch.arange(tq, device=q.device), right=True) - 1
        seq_k = torch.searchsorted(cu_seqlens_k, torch.arange(tk, device=q.device), right=True) - 1
        pos_q = torch.arange(tq, device=q.device) - cu_seqlens_q[seq_q]
        pos_k = torch.arange(tk, device=q.device) - cu_seqlens_k[seq_k]
        len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1])[seq_q]
        len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1])[seq_q]
        allowed = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= (pos_q + len_k - len_q)[:, None])
        kk = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(0, 1)  # [Hq, Tk, D]
        vv = v.float().repeat_interleave(q.shape[1] // v.shape[1], dim=1).transpose(0, 1)
        s = q.float().transpose(0, 1) @ kk.transpose(1, 2) / d ** 0.5  # [Hq, Tq, Tk]
        s = s.masked_fill(~allowed[None], float("-inf"))
        return (torch.softmax(s, dim=-1) @ vv).transpose(0, 1).to(q.dtype)


def _inputs(hq, hkv, d, lens, device="cpu"):
    g = torch.Generator().manual_seed(13)
    t = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(t, h, d, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))
    return [q.to(device), k.to(device), v.to(device), cu.to(device), cu.clone().to(device), max(lens)]


def get_inputs():
    return _inputs(HQ, HKV, D, SEQ_LENS)


def bench_inputs(device="cuda"):
    return _inputs(BENCH["Hq"], BENCH["Hkv"], BENCH["D"], BENCH["SEQ_LENS"], device)


def get_init_inputs():
    return []
