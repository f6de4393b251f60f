"""Paged-KV decode over an SGLang-style token pool: k_buffer, v_buffer [POOL, Hkv, D] read through
req_to_token [B, MAX_CTX]; MQA expanded with expand + reshape; fp16."""
import torch
import torch.nn as nn

B, HQ, HKV, D, MAX_CTX, POOL = 2, 4, 1, 32, 96, 256
DTYPE = torch.float16


class Model(nn.Module):
    def forward(self, q, k_buffer, v_buffer, req_to_token, seq_lens):
        # q: [B, Hq, D]; k_buffer, v_buffer: [POOL, Hkv, D]; req_to_token: [B, MAX_CTX]; seq_lens: [B]
        b, hq, d = q.shape
        k = k_buffer[req_to_token].transpose(1, 2)  # [B, Hkv, MAX_CTX, D]
        v = v_buffer[req_to_token].transpose(1, 2)
        g = hq // k.shape[1]
        k = k[:, :, None].expand(b, k.shape[1], g, MAX_CTX, d).reshape(b, hq, MAX_CTX, d)
        v = v[:, :, None].expand(b, v.shape[1], g, MAX_CTX, d).reshape(b, hq, MAX_CTX, d)
        s = torch.matmul(q.unsqueeze(2), k.transpose(2, 3)) / d ** 0.5
        valid = torch.arange(MAX_CTX)[None, :] < seq_lens[:, None]  # [B, MAX_CTX]
        s = torch.where(valid[:, None, None, :], s, float("-inf"))
        return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)[:, :, 0]


def get_inputs():
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.randperm(POOL, generator=g)[:B * MAX_CTX].reshape(B, MAX_CTX).to(torch.int32)
    seq_lens = torch.tensor([50, 96], dtype=torch.int32)
    k_buffer = torch.randn(POOL, HKV, D, generator=g).to(DTYPE)
    v_buffer = torch.randn(POOL, HKV, D, generator=g).to(DTYPE)
    return [torch.randn(B, HQ, D, generator=g).to(DTYPE), k_buffer, v_buffer, req_to_token, seq_lens]


def get_init_inputs():
    return []
