"""A dense causal spec with a learned attention sink per head (gpt-oss style): one logit column appended before the
softmax and dropped after it. Generation refuses dense sinks (tests: the refusal path)."""
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.linspace(1.0, 3.0, 4))

    def forward(self, q, k, v):
        s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        s = s.masked_fill(torch.arange(s.shape[-1]) > torch.arange(s.shape[-2])[:, None], float("-inf"))
        sink = self.sinks[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
        return torch.cat([s, sink], dim=-1).softmax(dim=-1)[..., :-1] @ v

def get_inputs():
    return [torch.randn(1, 4, 24, 16) for _ in range(3)]

def get_init_inputs():
    return []
