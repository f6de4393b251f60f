"""Paged-KV decode in vLLM's layout with a sliding window of 128 keys and attention sinks (gpt-oss style), bf16.

q [B, Hq, D]: one new token per sequence; k_cache, v_cache [NUM_PAGES, PAGE, Hkv, D]; block_table [B, MAX_PAGES] int32
(the pages of each sequence, in order; sequences may share pages, as with prefix caching); seq_lens [B] int32 (a
sequence's keys are its first seq_lens[b] cache slots; 0 is an empty sequence). The query sits at position
seq_lens[b] - 1 and sees the keys in (seq_lens[b] - 1 - WINDOW, seq_lens[b] - 1]. Each query head has a learned sink
logit that joins the softmax's denominator and carries no value. Returns [B, Hq, D] in q's dtype (0 for an empty
sequence). Written 2026-12-05, before any serving lowering or tuning.
"""
import torch
import torch.nn as nn

B, HQ, HKV, D = 3, 4, 2, 64
PAGE, MAX_PAGES = 16, 20  # up to 320 keys per sequence
NUM_PAGES = B * MAX_PAGES + 3
WINDOW = 128
BENCH = dict(B=64, Hq=64, Hkv=8, D=64, PAGE=16, MAX_PAGES=512)  # gpt-oss-120b heads, 8K-token contexts


class Model(nn.Module):
    def __init__(self, num_heads=HQ):
        super().__init__()
        self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, num_heads))

    def forward(self, q, k_cache, v_cache, block_table, seq_lens):
        b, hq, d = q.shape
        k = k_cache[block_table].flatten(1, 2).transpose(1, 2)  # [B, Hkv, MAX_PAGES * PAGE, D]
        v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
        k = k.repeat_interleave(hq // k.shape[1], dim=1).float()
        v = v.repeat_interleave(hq // v.shape[1], dim=1).float()
        s = (q.float().unsqueeze(2) @ k.transpose(-2, -1)) * d ** -0.5  # [B, Hq, 1, N]
        pos = torch.arange(k.shape[2], device=q.device)
        last = (seq_lens.long() - 1)[:, None, None, None]
        s = s.masked_fill((pos > last) | (pos <= last - WINDOW), float("-inf"))
        sink = self.sinks.float()[None, :, None, None].expand(b, hq, 1, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        return (p @ v).squeeze(2).to(q.dtype)


def _inputs(b, hq, hkv, d, page, max_pages, lens, device="cpu"):
    g = torch.Generator().manual_seed(0)
    num_pages = b * max_pages + 3
    table = torch.randperm(num_pages, generator=g)[:b * max_pages].reshape(b, max_pages)
    table[-1, :2] = table[-2, :2]  # the last two sequences share a cached prefix of two pages
    k_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    return [t.to(device) for t in (q, k_cache, v_cache, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32))]


def get_inputs():
    return _inputs(B, HQ, HKV, D, PAGE, MAX_PAGES, [0, 150, 301])


def bench_inputs(device="cuda"):
    s = BENCH
    lens = [int(x) for x in torch.linspace(1024, s["PAGE"] * s["MAX_PAGES"], s["B"])]
    return _inputs(s["B"], s["Hq"], s["Hkv"], s["D"], s["PAGE"], s["MAX_PAGES"], lens, device)


def get_init_inputs():
    return []


def bench_init_inputs():
    return [BENCH["Hq"]]
