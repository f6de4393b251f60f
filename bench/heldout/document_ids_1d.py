"""Document mask with the ids as one 1-D tensor [S] shared by the batch, bidirectional, bf16, D=64.

Variant: packed documents, the same packing for every batch row (one int64 doc_ids [S]
forward input); query i sees key j iff doc_ids[i] == doc_ids[j] (no causal part).
Written with masked_fill on a bool [S, S] matrix. fp32 math from bf16 inputs, bf16 output.
Small shape (CPU check): B=2, H=2, S=227, D=64, bf16; documents of lengths (50, 101, 76).
Bench shape (H200, bf16): B=4, H=16, S=8192, D=64; 16 documents of random length.
"""
import torch
import torch.nn as nn

BENCH = dict(B=4, Hq=16, Hkv=16, M=8192, N=8192, D=64)
SDPA = None


def ids_for(lengths) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


class Model(nn.Module):
    def forward(self, q, k, v, doc_ids):
        same = doc_ids[:, None] == doc_ids[None, :]                          # [S, S]
        s = (q.float() @ k.float().transpose(-2, -1)) / q.shape[-1] ** 0.5
        s = s.masked_fill(~same, float("-inf"))
        return (s.softmax(dim=-1) @ v.float()).to(q.dtype)


def get_inputs():
    q, k, v = (torch.randn(2, 2, 227, 64, dtype=torch.bfloat16) for _ in range(3))
    return [q, k, v, ids_for([50, 101, 76])]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, H, S, D = BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"]
    gen = torch.Generator().manual_seed(11)
    cuts = torch.sort(torch.randperm(S - 1, generator=gen)[:15] + 1).values
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([S])])).tolist()
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16, device=device) for _ in range(3))
    return [q, k, v, ids_for(lengths).to(device)]


def flex_mods(*inputs):
    doc_ids = inputs[3]

    def same_document(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]

    return None, same_document
