"""Chunked prefill against a paged prefix (vLLM layout) with a prefix-LM mask (PaliGemma-style), bf16.

forward(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, prefix_lens): q [Tq, Hq, D] holds, packed, the
new tokens of each sequence (a chunk; query_start_loc [B + 1] int32 its offsets); their keys and values are already in
the cache with the earlier context: k_cache, v_cache [NUM_PAGES, PAGE, Hkv, D], block_table [B, MAX_PAGES] int32,
seq_lens [B] int32 the context length including the chunk. The chunk's last token is at position seq_lens[b] - 1.
Query at position i sees key j < seq_lens[b] when j < prefix_lens[b] (the bidirectional prefix, an image and a
prompt) or j <= i (causal after it). Returns [Tq, Hq, D] in q's dtype. Written 2026-12-05, before any serving
lowering or tuning.
"""
import torch
import torch.nn as nn

HQ, HKV, D = 4, 1, 64
PAGE, MAX_PAGES = 16, 16
CHUNKS = (16, 40, 1)  # new tokens per sequence
CONTEXT = (16, 200, 97)  # seq_lens: context including the chunk
PREFIX = (20, 64, 0)  # bidirectional prefix per sequence
BENCH = dict(Hq=8, Hkv=1, D=256, PAGE=16, MAX_PAGES=512, CHUNKS=(512,) * 8, CONTEXT=(8192, 4096, 2048, 512, 8000, 6000,
             3000, 1024), PREFIX=(256, 1024, 256, 0, 512, 256, 2048, 300))  # PaliGemma-2 (Gemma-2 2B) heads


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, prefix_lens):
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
        keep = (j < seq_lens[seq][:, None]) & ((j < prefix_lens[seq][:, None]) | (j <= pos[:, None]))
        s = s.masked_fill(~keep[:, None, :], float("-inf"))
        return torch.einsum("thn,tnhd->thd", s.softmax(-1), v).to(q.dtype)


def _inputs(hq, hkv, d, page, max_pages, chunks, context, prefix, device="cpu"):
    g = torch.Generator().manual_seed(3)
    b = len(chunks)
    num_pages = b * max_pages + 2
    table = torch.randperm(num_pages, generator=g)[:b * max_pages].reshape(b, max_pages).to(torch.int32)
    k_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    q = torch.randn(sum(chunks), hq, d, generator=g).to(torch.bfloat16)
    qsl = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    ints = [torch.tensor(x, dtype=torch.int32) for x in (context, prefix)]
    return [t.to(device) for t in (q, k_cache, v_cache, table, ints[0], qsl, ints[1])]


def get_inputs():
    return _inputs(HQ, HKV, D, PAGE, MAX_PAGES, CHUNKS, CONTEXT, PREFIX)


def bench_inputs(device="cuda"):
    s = BENCH
    return _inputs(s["Hq"], s["Hkv"], s["D"], s["PAGE"], s["MAX_PAGES"], s["CHUNKS"], s["CONTEXT"], s["PREFIX"], device)


def get_init_inputs():
    return []
