"""Decode over an SGLang-style token pool (k_buffer, v_buffer [POOL, Hkv, D] read through req_to_token [B, MAX_CTX]),
GQA 2:1, with a learned attention sink per query head (gpt-oss), fp16. A test serving spec (the held-out ones are
in bench/heldout_serving)."""
import torch
import torch.nn as nn

B, HQ, HKV, D, MAX_CTX, POOL = 3, 4, 2, 32, 80, 300


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))

    def forward(self, q, k_buffer, v_buffer, req_to_token, seq_lens):
        b, hq, d = q.shape
        k = k_buffer[req_to_token].transpose(1, 2).repeat_interleave(hq // k_buffer.shape[1], dim=1).float()
        v = v_buffer[req_to_token].transpose(1, 2).repeat_interleave(hq // v_buffer.shape[1], dim=1).float()
        s = (q.unsqueeze(2).float() @ k.transpose(-2, -1)) / d ** 0.5  # [B, Hq, 1, MAX_CTX]
        s = s.masked_fill(torch.arange(MAX_CTX)[None, None, None, :] >= seq_lens[:, None, None, None], float("-inf"))
        sink = self.sinks.float()[None, :, None, None].expand(b, hq, 1, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        return (p @ v).squeeze(2).to(q.dtype)


def get_inputs():
    g = torch.Generator().manual_seed(5)
    req_to_token = torch.randperm(POOL, generator=g)[:B * MAX_CTX].reshape(B, MAX_CTX).to(torch.int32)
    seq_lens = torch.tensor([0, 33, 80], dtype=torch.int32)  # an empty sequence: all weight on the sink, o = 0
    k_buffer = torch.randn(POOL, HKV, D, generator=g).to(torch.float16)
    v_buffer = torch.randn(POOL, HKV, D, generator=g).to(torch.float16)
    return [torch.randn(B, HQ, D, generator=g).to(torch.float16), k_buffer, v_buffer, req_to_token, seq_lens]


def get_init_inputs():
    return []
