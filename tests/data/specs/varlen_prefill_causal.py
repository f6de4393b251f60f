"""Packed variable-length prefill, causal within each sequence, GQA ratio 2, fp16.

q, k, v hold every sequence's tokens back to back ([T, H, D], the serving layout); cu_seqlens [B + 1]
gives where each sequence starts. Written as one attention over the packed tokens with a
block-diagonal mask: a token sees the earlier tokens of its own sequence.

Labelled retrieval spec (tests/data/specs): LABEL states the expected reference family,
the snippet kinds a transfer needs and the features tracing must find.
"""
import torch
import torch.nn as nn

SEQ_LENS = (40, 17, 71)
T, HQ, HKV, D = sum(SEQ_LENS), 4, 2, 64
DTYPE = torch.float16

LABEL = {
    "family": "serving_triton",
    "snippets": [
        "online_softmax",
        "mask_causal",
        "varlen"
    ],
    "features": {
        "mask": "causal",
        "causal": True,
        "sliding_window": False,
        "score_mod": "none",
        "alibi": False,
        "softcap": False,
        "gqa_ratio": 2,
        "head_dim": 64,
        "dtype": "fp16",
        "decode": False,
        "split_kv": False,
        "paged_kv": False,
        "varlen": True,
        "cross": False
    }
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v, cu_seqlens):
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: [B + 1] int32, cu_seqlens[0] = 0, cu_seqlens[-1] = T
        t, hq, d = q.shape
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        kh = k.transpose(0, 1).unsqueeze(0).repeat_interleave(hq // k.shape[1], dim=1)
        vh = v.transpose(0, 1).unsqueeze(0).repeat_interleave(hq // v.shape[1], dim=1)
        s = (qh @ kh.transpose(-2, -1)) / d ** 0.5
        pos = torch.arange(t, device=q.device)
        seq = torch.searchsorted(cu_seqlens, pos, right=True)  # the sequence of each token
        visible = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
        s = s.masked_fill(~visible, float("-inf"))
        o = torch.softmax(s.float(), dim=-1).to(q.dtype) @ vh  # [1, Hq, T, D]
        return o[0].transpose(0, 1)  # [T, Hq, D]


def get_inputs():
    cu_seqlens = torch.tensor([0, *torch.tensor(SEQ_LENS).cumsum(0).tolist()], dtype=torch.int32)
    return [torch.randn(T, HQ, D, dtype=DTYPE), torch.randn(T, HKV, D, dtype=DTYPE), torch.randn(T, HKV, D, dtype=DTYPE),
            cu_seqlens]


def get_init_inputs():
    return []
