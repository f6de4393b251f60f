"""Paged-KV decode in vLLM's layout, GQA 2:1, a 40-key sliding window and a tanh softcap of 30, bf16 (a tuning/test
serving spec; the held-out ones are in bench/heldout_serving).

q [B, Hq, D]; k_cache, v_cache [NUM_PAGES, PAGE, Hkv, D]; block_table [B, MAX_PAGES] int32; seq_lens [B] int32.
The query sits at position seq_lens[b] - 1 and sees the last 40 keys of its sequence. Returns [B, Hq, D] in q's dtype.
"""
import torch
import torch.nn as nn

B, HQ, HKV, D = 4, 4, 2, 64
PAGE, MAX_PAGES = 16, 6
WINDOW, CAP = 40, 30.0


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache, block_table, seq_lens):
        d = q.shape[-1]
        k = k_cache[block_table].flatten(1, 2).transpose(1, 2)  # [B, Hkv, MAX_PAGES * PAGE, D]
        v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float()
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).float()
        s = (q.unsqueeze(2).float() @ k.transpose(-2, -1)) / d ** 0.5  # [B, Hq, 1, N]
        s = CAP * torch.tanh(s / CAP)
        pos = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
        last = (seq_lens.long() - 1)[:, None, None, None]
        s = s.masked_fill((pos > last) | (pos <= last - WINDOW), float("-inf"))
        return (torch.softmax(s, dim=-1) @ v).squeeze(2).to(q.dtype)


def get_inputs():
    g = torch.Generator().manual_seed(3)
    num_pages = B * MAX_PAGES + 3
    table = torch.randperm(num_pages, generator=g)[:B * MAX_PAGES].reshape(B, MAX_PAGES).to(torch.int32)
    k_cache = torch.randn(num_pages, PAGE, HKV, D, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_pages, PAGE, HKV, D, generator=g).to(torch.bfloat16)
    seq_lens = torch.tensor([1, 23, 96, 57], dtype=torch.int32)
    return [torch.randn(B, HQ, D, generator=g).to(torch.bfloat16), k_cache, v_cache, table, seq_lens]


def get_init_inputs():
    return []
