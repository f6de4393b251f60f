"""Packed-sequence (document) attention: several documents packed along S; a token only
attends to earlier tokens of its own document. doc_ids: [B, S] int64 is a forward input.
q, k, v: [B, H, S, D] fp32."""
import torch
import torch.nn as nn
import torch.nn.functional as F

B, H, S, D = 2, 4, 128, 64
DOC_LENGTHS = [[40, 50, 38], [128], ]


def make_doc_ids():
    rows = []
    for lengths in DOC_LENGTHS + [[20, 108]] * (B - len(DOC_LENGTHS)):
        rows.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    return torch.stack(rows[:B])


class Model(nn.Module):
    def forward(self, q, k, v, doc_ids):
        same_doc = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]   # [B, 1, S, S]
        n = q.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=same_doc & causal)


def get_inputs():
    return [torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D), make_doc_ids()]


def get_init_inputs():
    return []
