"""Paged-KV decode in vLLM's layout, GQA 3:1 (6 query heads over 2 KV heads), ALiBi slopes per query head, fp16 (a
test serving spec: a variant that reads the head, so a grouped decode tile must give each row its own head; a group
of 3 leaves most rows of a 16-row tile to other groups' heads, and the last tile's rows run past Hq).

q [B, Hq, D]; k_cache, v_cache [NUM_PAGES, PAGE, Hkv, D]; block_table [B, MAX_PAGES] int32; seq_lens [B] int32 (one
sequence shorter than a page). The query sits at position seq_lens[b] - 1. Returns [B, Hq, D] in q's dtype.
"""
import torch
import torch.nn as nn

B, HQ, HKV, D = 4, 6, 2, 32
PAGE, MAX_PAGES = 16, 5


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("slopes", torch.tensor([2.0 ** (-(i + 1)) for i in range(HQ)]))

    def forward(self, q, k_cache, v_cache, block_table, seq_lens):
        b, hq, d = q.shape
        k = k_cache[block_table].flatten(1, 2).transpose(1, 2)  # [B, Hkv, MAX_PAGES * PAGE, D]
        v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
        k = k.repeat_interleave(hq // k.shape[1], dim=1).float()
        v = v.repeat_interleave(hq // v.shape[1], dim=1).float()
        s = (q.unsqueeze(2).float() @ k.transpose(-2, -1)) * d ** -0.5  # [B, Hq, 1, N]
        pos = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
        last = (seq_lens.long() - 1)[:, None, None, None]
        s = s + self.slopes[None, :, None, None] * (pos - last)
        s = s.masked_fill(pos > last, float("-inf"))
        return (torch.softmax(s, dim=-1) @ v).squeeze(2).to(q.dtype)


def get_inputs():
    g = torch.Generator().manual_seed(5)
    num_pages = B * MAX_PAGES + 2
    table = torch.randperm(num_pages, generator=g)[:B * MAX_PAGES].reshape(B, MAX_PAGES).to(torch.int32)
    k_cache = torch.randn(num_pages, PAGE, HKV, D, generator=g).to(torch.float16)
    v_cache = torch.randn(num_pages, PAGE, HKV, D, generator=g).to(torch.float16)
    seq_lens = torch.tensor([1, 9, 80, 33], dtype=torch.int32)
    return [torch.randn(B, HQ, D, generator=g).to(torch.float16), k_cache, v_cache, table, seq_lens]


def get_init_inputs():
    return []
