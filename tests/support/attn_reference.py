"""Dense fp32 torch attention for a Program's variant functions: the oracle in IR tests."""

from __future__ import annotations

import math

import torch

from kb.ir.evaluate import dense_scores_mask
from kb.ir.nodes import Program


def reference_attention(
    program: Program,
    q: torch.Tensor,  # [B, Hq, M, D]
    k: torch.Tensor,  # [B, Hkv, N, D]
    v: torch.Tensor,  # [B, Hkv, N, D]
    sm_scale: float | None = None,
    scalars: dict[str, float] | None = None,
    aux: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) in fp32; fully masked rows give o = 0 and lse = -inf."""
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    rep = Hq // Hkv
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    s = q.float() @ kf.transpose(-1, -2) * sm_scale
    env = {"B": B, "Hq": Hq, "Hkv": Hkv, "M": M, "N": N, "D": D, "sm_scale": sm_scale, **(scalars or {})}
    s, mask = dense_scores_mask(
        s, program.score_mod.body if program.score_mod else None,
        program.mask_mod.body if program.mask_mod else None, env, aux,
    )
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    o = p @ vf
    return o, lse
