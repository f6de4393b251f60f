"""Honest candidate: a flash-attention forward in Triton, written from scratch.

One program per (query block, batch*head); it walks the KV blocks with an online
softmax (running max `m`, running sum `l`, rescaled accumulator `acc`), applies the
causal mask (top-left aligned, like SDPA's `is_causal=True`) and skips KV blocks that
lie entirely above the diagonal. Ragged lengths are handled with masked loads; GQA maps
query head h to KV head h // (Hq // Hkv). Under TRITON_INTERPRET=1 this runs on CPU.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Triton 3.6's interpreter computes tl.dot on bf16/fp16 operands wrongly, so under
# TRITON_INTERPRET=1 the operands are upcast to fp32 (after P is rounded to the input dtype).
_UPCAST_DOT = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _kv_block(q, k_base, v_base, skn, skd, svn, svd, m_i, l_i, acc,
              start_n, offs_m, offs_n, offs_d, d_ok, Skv, scale_log2e,
              CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    cols = start_n + offs_n
    kv_ok = cols < Skv
    k = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd, mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision="ieee") * scale_log2e  # s: [BLOCK_M, BLOCK_N], log2 domain
    keep = kv_ok[None, :]
    if CAUSAL:
        keep = keep & (cols[None, :] <= offs_m[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row whose keys are all masked so far keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
    p = p.to(v.dtype)  # P is rounded to the input dtype before the PV product, as on the GPU
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attn_fwd(Q, K, V, O,
              sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              Hq, Hkv, Sq, Skv, scale_log2e,
              CAUSAL: tl.constexpr, UPCAST: tl.constexpr, KV_BLOCKS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // (Hq // Hkv)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = offs_m[:, None] < Sq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok & d_ok[None, :], other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The trip count is a constexpr because the interpreter cannot loop to a runtime bound
    # (Triton 3.6 with NumPy 2.4); causal block skipping is therefore a branch in the loop.
    for start_n in range(0, KV_BLOCKS * BLOCK_N, BLOCK_N):
        if (not CAUSAL) or (start_n < (pid_m + 1) * BLOCK_M):
            m_i, l_i, acc = _kv_block(q, k_base, v_base, skn, skd, svn, svd, m_i, l_i, acc,
                                      start_n, offs_m, offs_n, offs_d, d_ok, Skv, scale_log2e, CAUSAL, UPCAST)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=row_ok & d_ok[None, :])


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v. q: [B, Hq, Sq, D], k/v: [B, Hkv, Skv, D], Hq % Hkv == 0."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    block_m, block_n = 16, 16
    grid = (triton.cdiv(Sq, block_m), B * Hq)
    _attn_fwd[grid](
        q, k, v, o, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        Hq, Hkv, Sq, Skv, _LOG2E / math.sqrt(D),
        CAUSAL=causal, UPCAST=_UPCAST_DOT, KV_BLOCKS=triton.cdiv(Skv, block_n),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), D=D,
    )
    return o


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attention(q, k, v, self.causal)
