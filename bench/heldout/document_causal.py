"""Document (packed-sequence) causal attention, bf16, D=128.

Variant: several documents packed into one row; query i sees key j iff
doc_ids[b, i] == doc_ids[b, j] and j <= i. doc_ids is an int32 [B, S] forward input;
the mask becomes an additive 0 / -inf bias. fp32 math from bf16 inputs, bf16 output.
Small shape (CPU check): B=2, H=2, S=283, D=128, bf16; documents of lengths
(40, 143, 100) and (200, 83).
Bench shape (H200, bf16): B=2, H=16, S=16384, D=128; ~12 documents of random length per row.
"""
import torch
import torch.nn as nn

BENCH = dict(B=2, Hq=16, Hkv=16, M=16384, N=16384, D=128)
SDPA = None


def pack(lengths) -> torch.Tensor:
    """doc ids 0, 0, ..., 1, 1, ... for documents of the given lengths."""
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])


class Model(nn.Module):
    def forward(self, q, k, v, doc_ids):
        S = q.size(2)
        same_doc = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)                 # [B, S, S]
        causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        allowed = (same_doc & causal).unsqueeze(1)                                  # [B, 1, S, S]
        bias = torch.zeros(allowed.shape, device=q.device).masked_fill(~allowed, float("-inf"))
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.size(-1) ** -0.5
        p = torch.softmax(s + bias, dim=-1)
        return torch.matmul(p, v.float()).type_as(q)


def get_inputs():
    q, k, v = (torch.randn(2, 2, 283, 128, dtype=torch.bfloat16) for _ in range(3))
    doc_ids = torch.stack([pack([40, 143, 100]), pack([200, 83])])
    return [q, k, v, doc_ids]


def get_init_inputs():
    return []


def bench_inputs(device: str) -> list[torch.Tensor]:
    B, H, S, D = BENCH["B"], BENCH["Hq"], BENCH["M"], BENCH["D"]
    gen = torch.Generator().manual_seed(2024)
    rows = []
    for _ in range(B):
        cuts = torch.randperm(S - 1, generator=gen)[:11] + 1
        starts = torch.zeros(S, dtype=torch.int32)
        starts[cuts] = 1
        rows.append(torch.cumsum(starts, 0).to(torch.int32))
    doc_ids = torch.stack(rows).to(device)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16, device=device) for _ in range(3))
    return [q, k, v, doc_ids]


def flex_mods(*inputs):
    doc_ids = inputs[3]

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return None, document_causal
