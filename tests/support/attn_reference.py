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


def dense_block_classes(mask_mod, M: int, N: int, BLOCK_M: int, BLOCK_N: int) -> torch.Tensor:
    """[cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)] IR block classes (0 empty, 1 partial, 2 full) of `mask_mod(q_idx, kv_idx)`
    evaluated on every pair: the oracle of the closed-form tests and of the module's block-class kernel."""
    nm, nn = -(-M // BLOCK_M), -(-N // BLOCK_N)
    q_idx, kv_idx = torch.arange(nm * BLOCK_M).view(-1, 1), torch.arange(nn * BLOCK_N).view(1, -1)
    in_range = (q_idx < M) & (kv_idx < N)
    attend = torch.as_tensor(mask_mod(q_idx, kv_idx)).bool().expand_as(in_range) & in_range
    n_in = in_range.view(nm, BLOCK_M, nn, BLOCK_N).sum((1, 3))
    n_att = attend.view(nm, BLOCK_M, nn, BLOCK_N).sum((1, 3))
    ragged = (torch.arange(1, nn + 1) * BLOCK_N > N).view(1, nn)
    return torch.where(n_att == 0, 0, torch.where((n_att == n_in) & ~ragged, 2, 1))
