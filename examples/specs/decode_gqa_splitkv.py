"""Decode step with a long KV cache (split-KV friendly): one new query token per sequence,
2048 cached keys, GQA 32 query heads over 8 kv heads, bf16. q: [B, 32, 1, 128]."""
import torch
import torch.nn as nn

B, HQ, HKV, KV_LEN, D = 2, 32, 8, 2048, 128


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache):
        rep = q.shape[1] // k_cache.shape[1]
        k = k_cache.repeat_interleave(rep, dim=1)
        v = v_cache.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, v)


def get_inputs():
    return [torch.randn(B, HQ, 1, D, dtype=torch.bfloat16),
            torch.randn(B, HKV, KV_LEN, D, dtype=torch.bfloat16),
            torch.randn(B, HKV, KV_LEN, D, dtype=torch.bfloat16)]


def get_init_inputs():
    return []
