"""Honest candidate with a backward: flash attention forward and backward in Triton, from scratch.

`ModelNew` wraps a `torch.autograd.Function`: its forward runs a Triton kernel that writes O and
the log-sum-exp (log2 domain) per row; its backward computes Δ = rowsum(dO ∘ O) with elementwise
torch ops (allowed: no matmul, nothing larger than the inputs) and launches two Triton kernels,
one per KV block for dk/dv (looping over the query blocks and, for GQA, over the query heads that
share the KV head) and one per query block for dq. P is recomputed from the saved LSE:
    P = exp2(S * log2(e) / sqrt(D) - lse2),   dV = Pᵀ dO,   dP = dO Vᵀ,
    dS = P ∘ (dP − Δ),   dQ = dS K / sqrt(D),   dK = dSᵀ Q / sqrt(D).
Causal is top-left aligned (SDPA's `is_causal`). Under TRITON_INTERPRET=1 this runs on CPU; loop
trip counts are constexprs and dot operands are upcast there, as in triton_flash.py.

The cheats in tests/cheats/bwd_*.py import `flash_forward` / `flash_backward` from here, so each
differs from this honest candidate only by its hack.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_UPCAST_DOT = os.environ.get("TRITON_INTERPRET") == "1"
_BLOCK = 16


@triton.jit
def _fwd_block(q, k_base, v_base, skn, skd, svn, svd, m_i, l_i, acc, start_n, offs_m, offs_n, offs_d, d_ok,
               Skv, scale_log2e, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    cols = start_n + offs_n
    kv_ok = cols < Skv
    kt = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd, mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision="ieee") * scale_log2e
    keep = kv_ok[None, :]
    if CAUSAL:
        keep = keep & (cols[None, :] <= offs_m[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _fwd(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
         Hq, Hkv, Sq, Skv, scale_log2e, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, KV_BLOCKS: tl.constexpr,
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
    row_ok = offs_m < Sq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, KV_BLOCKS * BLOCK_N, BLOCK_N):
        if (not CAUSAL) or (start_n < (pid_m + 1) * BLOCK_M):
            m_i, l_i, acc = _fwd_block(q, K + b * skb + hk * skh, V + b * svb + hk * svh, skn, skd, svn, svd,
                                       m_i, l_i, acc, start_n, offs_m, offs_n, offs_d, d_ok, Skv, scale_log2e,
                                       CAUSAL, UPCAST)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    # lse2 of a row with no visible key is +inf, so the backward's exp2(s - lse2) is 0 there
    lse2 = tl.where(l_i == 0.0, float("inf"), m_i + tl.log2(l_safe))
    tl.store(LSE + pid_bh * Sq + offs_m, lse2, mask=row_ok)


@triton.jit
def _probs(q, kt, lse2, rows, cols, row_ok, kv_ok, scale_log2e, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """P [BLOCK_M, BLOCK_N] recomputed from the saved log2-sum-exp; 0 outside the mask and the bounds."""
    if UPCAST:
        q = q.to(tl.float32)
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision="ieee") * scale_log2e
    keep = row_ok[:, None] & kv_ok[None, :]
    if CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None])
    return tl.where(keep, tl.exp2(s - lse2[:, None]), 0.0)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
              sdb, sdh, sdm, sdd, Hq, Hkv, Sq, Skv, scale_log2e, sm_scale, CAUSAL: tl.constexpr,
              UPCAST: tl.constexpr, GROUP: tl.constexpr, Q_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_ok = cols < Skv
    kv_mask = kv_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(GROUP):  # the query heads that read this KV head
        h = hk * GROUP + g
        for start_m in range(0, Q_BLOCKS * BLOCK_M, BLOCK_M):
            if (not CAUSAL) or (start_m + BLOCK_M > pid_n * BLOCK_N):
                rows = start_m + tl.arange(0, BLOCK_M)
                row_ok = rows < Sq
                q_mask = row_ok[:, None] & d_ok[None, :]
                q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
                do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + offs_d[None, :] * sdd, mask=q_mask, other=0.0)
                lse2 = tl.load(LSE + (b * Hq + h) * Sq + rows, mask=row_ok, other=0.0)
                delta = tl.load(DELTA + (b * Hq + h) * Sq + rows, mask=row_ok, other=0.0)
                p = _probs(q, tl.trans(k), lse2, rows, cols, row_ok, kv_ok, scale_log2e, CAUSAL, UPCAST)
                dv += _dot(tl.trans(p.to(do.dtype)), do, UPCAST)
                dp = _dot(do, tl.trans(v), UPCAST)
                ds = p * (dp - delta[:, None])
                dk += _dot(tl.trans(ds.to(q.dtype)), q, UPCAST)
    tl.store(DK + b * skb + hk * skh + cols[:, None] * skn + offs_d[None, :] * skd,
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * svb + hk * svh + cols[:, None] * svn + offs_d[None, :] * svd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
            sdb, sdh, sdm, sdd, Hq, Hkv, Sq, Skv, scale_log2e, sm_scale, CAUSAL: tl.constexpr,
            UPCAST: tl.constexpr, KV_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // (Hq // Hkv)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = rows < Sq
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + offs_d[None, :] * sdd, mask=q_mask, other=0.0)
    lse2 = tl.load(LSE + pid_bh * Sq + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh * Sq + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, KV_BLOCKS * BLOCK_N, BLOCK_N):
        if (not CAUSAL) or (start_n < (pid_m + 1) * BLOCK_M):
            cols = start_n + tl.arange(0, BLOCK_N)
            kv_ok = cols < Skv
            kv_mask = kv_ok[:, None] & d_ok[None, :]
            k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
            p = _probs(q, tl.trans(k), lse2, rows, cols, row_ok, kv_ok, scale_log2e, CAUSAL, UPCAST)
            dp = _dot(do, tl.trans(v), UPCAST)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, UPCAST)
    tl.store(DQ + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def _consts(q: torch.Tensor, k: torch.Tensor) -> dict[str, int]:
    D = q.shape[3]
    return dict(BLOCK_M=_BLOCK, BLOCK_N=_BLOCK, BLOCK_D=max(16, triton.next_power_of_2(D)), D=D, UPCAST=_UPCAST_DOT)


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, Hq, Sq, D], lse2 [B, Hq, Sq] fp32). q: [B, Hq, Sq, D], k/v: [B, Hkv, Skv, D]."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    _fwd[(triton.cdiv(Sq, _BLOCK), B * Hq)](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), Hq, Hkv, Sq, Skv,
        _LOG2E / math.sqrt(D), CAUSAL=causal, KV_BLOCKS=triton.cdiv(Skv, _BLOCK), **_consts(q, k))
    return o, lse


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for dO = `do`, from the forward's saved O and lse2."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    q, k, v, do = (t.contiguous() for t in (q, k, v, do))  # the gradients are written with these strides
    delta = (do.float() * o.float()).sum(-1).contiguous()  # Δ [B, Hq, Sq]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = (Hq, Hkv, Sq, Skv, _LOG2E / math.sqrt(D), 1.0 / math.sqrt(D))
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    _bwd_dkdv[(triton.cdiv(Skv, _BLOCK), B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, *strides, *common, CAUSAL=causal, GROUP=Hq // Hkv,
        Q_BLOCKS=triton.cdiv(Sq, _BLOCK), **_consts(q, k))
    _bwd_dq[(triton.cdiv(Sq, _BLOCK), B * Hq)](
        q, k, v, do, lse, delta, dq, *strides, *common, CAUSAL=causal, KV_BLOCKS=triton.cdiv(Skv, _BLOCK),
        **_consts(q, k))
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        o, lse = flash_forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.causal)
        return dq, dk, dv, None


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return FlashAttention.apply(q, k, v, self.causal)
