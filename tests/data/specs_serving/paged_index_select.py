"""Paged decode gathering pages with index_select over a flattened table (not supported: read the
cache as k_cache[block_table], see tests/data/specs/decode_paged_gqa.py)."""
import torch
import torch.nn as nn

B, H, D, PAGE, MAX_PAGES = 2, 2, 32, 8, 4


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache, block_table, seq_lens):
        k = torch.index_select(k_cache, 0, block_table.flatten()).reshape(B, MAX_PAGES * PAGE, H, D).transpose(1, 2)
        v = torch.index_select(v_cache, 0, block_table.flatten()).reshape(B, MAX_PAGES * PAGE, H, D).transpose(1, 2)
        s = q.unsqueeze(2) @ k.transpose(-2, -1) / D ** 0.5
        s = s.masked_fill(torch.arange(MAX_PAGES * PAGE) >= seq_lens[:, None, None, None], float("-inf"))
        return (torch.softmax(s, dim=-1) @ v).squeeze(2)


def get_inputs():
    block_table = torch.randperm(B * MAX_PAGES).reshape(B, MAX_PAGES).to(torch.int32)
    return [torch.randn(B, H, D), torch.randn(B * MAX_PAGES, PAGE, H, D), torch.randn(B * MAX_PAGES, PAGE, H, D),
            block_table, torch.tensor([5, 30], dtype=torch.int32)]


def get_init_inputs():
    return []
