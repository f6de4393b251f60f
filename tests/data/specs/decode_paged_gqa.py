"""Paged-KV decode, GQA ratio 4, vLLM-style page table over a [NUM_PAGES, PAGE, Hkv, D] cache, bf16.

One query token per sequence; each sequence's keys live in the cache pages its row of
block_table lists, and only the first seq_lens[b] keys count. Written the way a user writes the
reference: gather the pages, flatten them into one key axis, mask keys at or past seq_lens.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import torch
import torch.nn as nn

B, HQ, HKV, D = 3, 8, 2, 64
PAGE, MAX_PAGES = 16, 8  # up to 128 keys per sequence
NUM_PAGES = B * MAX_PAGES + 4
DTYPE = torch.bfloat16

LABEL = {
    "family": "serving_triton",
    "snippets": [
        "online_softmax",
        "gqa",
        "split_kv_combine"
    ],
    "features": {
        "mask": "none",
        "causal": False,
        "sliding_window": False,
        "score_mod": "none",
        "alibi": False,
        "softcap": False,
        "gqa_ratio": 4,
        "head_dim": 64,
        "dtype": "bf16",
        "decode": True,
        "split_kv": True,
        "paged_kv": True,
        "varlen": False,
        "cross": False
    }
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k_cache, v_cache, block_table, seq_lens):
        # q: [B, Hq, D]; k_cache, v_cache: [NUM_PAGES, PAGE, Hkv, D]; block_table: [B, MAX_PAGES]; seq_lens: [B]
        b, hq, d = q.shape
        k = k_cache[block_table].flatten(1, 2).transpose(1, 2)  # [B, Hkv, MAX_PAGES * PAGE, D]
        v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
        k = k.repeat_interleave(hq // k.shape[1], dim=1)
        v = v.repeat_interleave(hq // v.shape[1], dim=1)
        s = (q.unsqueeze(2) @ k.transpose(-2, -1)) * d ** -0.5  # [B, Hq, 1, N]
        pos = torch.arange(k.shape[2], device=q.device)
        s = s.masked_fill(pos[None, None, None, :] >= seq_lens[:, None, None, None], float("-inf"))
        return (torch.softmax(s.float(), dim=-1).to(q.dtype) @ v).squeeze(2)  # [B, Hq, D]


def get_inputs():
    g = torch.Generator().manual_seed(0)
    block_table = torch.randperm(NUM_PAGES, generator=g)[:B * MAX_PAGES].reshape(B, MAX_PAGES).to(torch.int32)
    seq_lens = torch.tensor([37, 128, 90], dtype=torch.int32)
    k_cache = torch.randn(NUM_PAGES, PAGE, HKV, D, generator=g).to(DTYPE)
    v_cache = torch.randn(NUM_PAGES, PAGE, HKV, D, generator=g).to(DTYPE)
    return [torch.randn(B, HQ, D, generator=g).to(DTYPE), k_cache, v_cache, block_table, seq_lens]


def get_init_inputs():
    return []
