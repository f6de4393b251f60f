"""Chunked prefill against a paged cache (vLLM's unified-attention form): q [Tq, Hq, D] holds each sequence's new
tokens packed (query_start_loc [B + 1] their offsets; one sequence has none this step), its keys and values are in
the cache with the earlier context (k_cache, v_cache [NUM_PAGES, PAGE, Hkv, D], block_table [B, MAX_PAGES],
seq_lens [B] the context including the chunk). Causal from the chunk's position (token i of a chunk of c new tokens
is at seq_lens[b] - c + i) with a tanh softcap of 20, GQA 2:1, fp16. A test serving spec (the held-out ones are in
bench/heldout_serving)."""
import torch
import torch.nn as nn

HQ, HKV, D, PAGE, MAX_PAGES = 4, 2, 32, 16, 8
CHUNKS = (9, 0, 33, 1)
CONTEXT = (9, 20, 100, 70)


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache, block_table, seq_lens, query_start_loc):
        tq = q.shape[0]
        t = torch.arange(tq)
        seq = torch.searchsorted(query_start_loc, t, right=True) - 1
        chunk = query_start_loc[1:] - query_start_loc[:-1]
        pos = seq_lens[seq] - chunk[seq] + (t - query_start_loc[seq])
        k = k_cache[block_table].flatten(1, 2)[seq].float().repeat_interleave(q.shape[1] // k_cache.shape[2], dim=2)
        v = v_cache[block_table].flatten(1, 2)[seq].float().repeat_interleave(q.shape[1] // v_cache.shape[2], dim=2)
        s = torch.einsum("thd,tnhd->thn", q.float(), k) * q.shape[-1] ** -0.5
        s = 20.0 * torch.tanh(s / 20.0)
        j = torch.arange(k.shape[1])[None, :]
        keep = (j < seq_lens[seq][:, None]) & (j <= pos[:, None])
        s = s.masked_fill(~keep[:, None, :], float("-inf"))
        return torch.einsum("thn,tnhd->thd", s.softmax(-1), v).to(q.dtype)


def get_inputs():
    g = torch.Generator().manual_seed(5)
    b = len(CHUNKS)
    num_pages = b * MAX_PAGES + 3
    table = torch.randperm(num_pages, generator=g)[:b * MAX_PAGES].reshape(b, MAX_PAGES).to(torch.int32)
    k_cache = torch.randn(num_pages, PAGE, HKV, D, generator=g).half()
    v_cache = torch.randn(num_pages, PAGE, HKV, D, generator=g).half()
    q = torch.randn(sum(CHUNKS), HQ, D, generator=g).half()
    qsl = torch.tensor([0, *torch.tensor(CHUNKS).cumsum(0).tolist()], dtype=torch.int32)
    return [q, k_cache, v_cache, table, torch.tensor(CONTEXT, dtype=torch.int32), qsl]


def get_init_inputs():
    return []
