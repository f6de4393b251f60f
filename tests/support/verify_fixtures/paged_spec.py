"""Paged-KV decode (vLLM layout), fp32: q [B, Hq, D], caches [NUM_PAGES, PAGE, Hkv, D], block_table [B, MAX_PAGES],
seq_lens [B]; an empty sequence returns 0. Its own inputs hold pages in one fixed order, no shared page and no empty sequence."""
import torch
import torch.nn as nn

B, HQ, HKV, D, PAGE, MAX_PAGES = 4, 2, 1, 16, 4, 5


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache, block_table, seq_lens):
        k = k_cache[block_table].flatten(1, 2).transpose(1, 2)  # [B, Hkv, MAX_PAGES * PAGE, D]
        v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = (q.unsqueeze(2) @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        s = s.masked_fill(torch.arange(k.shape[2])[None, None, None, :] >= seq_lens[:, None, None, None], float("-inf"))
        return (torch.softmax(s, dim=-1).nan_to_num(0.0) @ v).squeeze(2)


def get_inputs():
    g = torch.Generator().manual_seed(0)
    table = torch.arange(B * MAX_PAGES, dtype=torch.int32).reshape(B, MAX_PAGES)
    k_cache, v_cache = (torch.randn(B * MAX_PAGES, PAGE, HKV, D, generator=g) for _ in range(2))
    return [torch.randn(B, HQ, D, generator=g), k_cache, v_cache, table, torch.tensor([7, 20, 3, 12], dtype=torch.int32)]


def get_init_inputs():
    return []
