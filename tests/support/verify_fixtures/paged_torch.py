"""Honest torch paged decode (torch-baseline mode): each sequence's keys gathered page by page through its table."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, q, k_cache, v_cache, block_table, seq_lens):
        page, out = k_cache.shape[1], torch.zeros_like(q)
        for b in range(q.shape[0]):
            n = int(seq_lens[b])
            if n == 0:
                continue
            rows = block_table[b, torch.arange(n) // page].long() * page + torch.arange(n) % page
            k = k_cache.flatten(0, 1)[rows].transpose(0, 1).repeat_interleave(q.shape[1] // k_cache.shape[2], 0)
            v = v_cache.flatten(0, 1)[rows].transpose(0, 1).repeat_interleave(q.shape[1] // v_cache.shape[2], 0)
            p = torch.softmax((k @ q[b].unsqueeze(-1)).squeeze(-1) * q.shape[-1] ** -0.5, dim=-1)  # [Hq, n]
            out[b] = (p.unsqueeze(1) @ v).squeeze(1)
        return out
