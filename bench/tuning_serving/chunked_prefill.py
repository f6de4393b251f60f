"""Tuning spec (not held out): chunked prefill against a paged prefix (vLLM layout), causal, GQA, bf16.

forward(q, k_cache, v_cache, block_table, seq_lens, query_start_loc): q [Tq, Hq, D] holds, packed, the new tokens of
each sequence (query_start_loc [B + 1] int32 their offsets); their keys are already in the cache with the earlier
context: k_cache, v_cache [NUM_PAGES, PAGE, Hkv, D], block_table [B, MAX_PAGES] int32, seq_lens [B] int32 the context
length including the chunk, whose last token is at position seq_lens[b] - 1. Query at position i sees key j <= i.
Returns [Tq, Hq, D] in q's dtype. Written 2026-12-07 to measure serving designs on (`python -m
bench.gpu.serving_tune`), apart from bench/heldout_serving/.
"""
import torch
import torch.nn as nn

HQ, HKV, D = 4, 2, 64
PAGE, MAX_PAGES = 16, 16
CHUNKS = (16, 33, 1)
CONTEXT = (16, 180, 90)
BENCH = dict(Hq=16, Hkv=4, D=128, PAGE=16, MAX_PAGES=512, CHUNKS=(256,) * 8, CONTEXT=(6000, 2048, 8192, 300, 4096,
             1000, 7000, 3000))


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache, block_table, seq_lens, query_start_loc):
        tq, hq, d = q.shape
        seq = torch.searchsorted(query_start_loc, torch.arange(tq, device=q.device), right=True) - 1  # [Tq]
        chunk = query_start_loc[1:] - query_start_loc[:-1]
        pos = seq_lens[seq] - chunk[seq] + (torch.arange(tq, device=q.device) - query_start_loc[seq])  # [Tq]
        k = k_cache[block_table].flatten(1, 2)[seq].float()  # [Tq, N, Hkv, D]
        v = v_cache[block_table].flatten(1, 2)[seq].float()
        k = k.repeat_interleave(hq // k.shape[2], dim=2)
        v = v.repeat_interleave(hq // v.shape[2], dim=2)
        s = torch.einsum("thd,tnhd->thn", q.float(), k) * d ** -0.5
        j = torch.arange(k.shape[1], device=q.device)[None, :]
        keep = (j < seq_lens[seq][:, None]) & (j <= pos[:, None])
        s = s.masked_fill(~keep[:, None, :], float("-inf"))
        return torch.einsum("thn,tnhd->thd", s.softmax(-1), v).to(q.dtype)


def _inputs(hq, hkv, d, page, max_pages, chunks, context, device="cpu"):
    g = torch.Generator().manual_seed(14)
    b = len(chunks)
    num_pages = b * max_pages + 2
    table = torch.randperm(num_pages, generator=g)[:b * max_pages].reshape(b, max_pages).to(torch.int32)
    k_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    q = torch.randn(sum(chunks), hq, d, generator=g).to(torch.bfloat16)
    qsl = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    return [t.to(device) for t in (q, k_cache, v_cache, table, torch.tensor(context, dtype=torch.int32), qsl)]


def get_inputs():
    return _inputs(HQ, HKV, D, PAGE, MAX_PAGES, CHUNKS, CONTEXT)


def bench_inputs(device="cuda"):
    s = BENCH
    return _inputs(s["Hq"], s["Hkv"], s["D"], s["PAGE"], s["MAX_PAGES"], s["CHUNKS"], s["CONTEXT"], device)


def get_init_inputs():
    return []
