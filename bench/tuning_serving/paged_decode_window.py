"""Tuning spec (not held out): paged-KV decode in vLLM's layout with a sliding window of 96 keys, GQA, D=64, bf16.

q [B, Hq, D]; k_cache, v_cache [NUM_PAGES, PAGE, Hkv, D]; block_table [B, MAX_PAGES] int32; seq_lens [B] int32. The
query sits at position seq_lens[b] - 1 and sees the keys in (seq_lens[b] - 1 - WINDOW, seq_lens[b] - 1]. Returns
[B, Hq, D] in q's dtype. Written 2026-12-07 to measure serving designs on (`python -m bench.gpu.serving_tune`), apart
from bench/heldout_serving/.
"""
import torch
import torch.nn as nn

B, HQ, HKV, D = 3, 8, 2, 64
PAGE, MAX_PAGES = 16, 16
WINDOW = 96
BENCH = dict(B=16, Hq=16, Hkv=4, D=64, PAGE=16, MAX_PAGES=1024)


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache, block_table, seq_lens):
        d = q.shape[-1]
        k = k_cache[block_table].flatten(1, 2).permute(0, 2, 1, 3).float()  # [B, Hkv, N, D]
        v = v_cache[block_table].flatten(1, 2).permute(0, 2, 1, 3).float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("bhd,bhnd->bhn", q.float(), k) / d ** 0.5
        pos = torch.arange(k.shape[2], device=q.device)[None, None, :]
        last = (seq_lens.long() - 1)[:, None, None]
        scores = scores.masked_fill((pos > last) | (pos <= last - WINDOW), float("-inf"))
        return torch.einsum("bhn,bhnd->bhd", scores.softmax(dim=-1), v).to(q.dtype)


def _inputs(b, hq, hkv, d, page, max_pages, lens, device="cpu"):
    g = torch.Generator().manual_seed(15)
    num_pages = b * max_pages + 3
    table = torch.randperm(num_pages, generator=g)[:b * max_pages].reshape(b, max_pages).to(torch.int32)
    k_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    return [t.to(device) for t in (q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32))]


def get_inputs():
    return _inputs(B, HQ, HKV, D, PAGE, MAX_PAGES, [7, 96, 250])


def bench_inputs(device="cuda"):
    s = BENCH
    lens = [int(x) for x in torch.linspace(1024, s["PAGE"] * s["MAX_PAGES"], s["B"])]
    return _inputs(s["B"], s["Hq"], s["Hkv"], s["D"], s["PAGE"], s["MAX_PAGES"], lens, device)


def get_init_inputs():
    return []
