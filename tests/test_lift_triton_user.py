"""The Triton lifter on kernels written the way users write them: parameters are recognised by use, not by name."""

from __future__ import annotations

import re
from pathlib import Path

from ingest.lift_triton import lift_file
from ingest.model import LiftReport, Provenance

# A forward pass in the style of Triton's tutorial: one N_CTX for both lengths, a constexpr
# HEAD_DIM, tl.trans(k), exp2 with log2(e) folded into the scale, the LSE stored in natural units.
TUTORIAL = '''\
import torch
import triton
import triton.language as tl


@triton.jit
def _attn_fwd(Q, K, V, sm_scale, M, Out,
              stride_qz, stride_qh, stride_qm, stride_qk,
              stride_kz, stride_kh, stride_kn, stride_kk,
              stride_vz, stride_vh, stride_vn, stride_vk,
              stride_oz, stride_oh, stride_om, stride_ok,
              Z, H, N_CTX,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    q_off = off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh
    k_off = off_z.to(tl.int64) * stride_kz + off_h.to(tl.int64) * stride_kh
    v_off = off_z.to(tl.int64) * stride_vz + off_h.to(tl.int64) * stride_vh
    o_off = off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + q_off + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk
    q = tl.load(q_ptrs, mask=offs_m[:, None] < N_CTX, other=0.0)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.44269504
    if IS_CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_CTX)
    else:
        hi = N_CTX
    for start_n in range(0, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = tl.load(K + k_off + cols[:, None] * stride_kn + offs_d[None, :] * stride_kk,
                    mask=cols[:, None] < N_CTX, other=0.0)
        qk = tl.dot(q, tl.trans(k))
        qk = tl.where(cols[None, :] < N_CTX, qk, float("-inf"))
        if IS_CAUSAL:
            qk = tl.where(offs_m[:, None] >= cols[None, :], qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_ij[:, None]
        p = tl.math.exp2(qk)
        l_ij = tl.sum(p, 1)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + l_ij
        acc = acc * alpha[:, None]
        v = tl.load(V + v_off + cols[:, None] * stride_vn + offs_d[None, :] * stride_vk,
                    mask=cols[:, None] < N_CTX, other=0.0)
        acc = tl.dot(p.to(tl.float16), v, acc)
        m_i = m_ij
    lse = (m_i + tl.math.log2(l_i)) / 1.44269504
    acc = acc / l_i[:, None]
    tl.store(M + off_hz * N_CTX + offs_m, lse, mask=offs_m < N_CTX)
    tl.store(Out + o_off + offs_m[:, None] * stride_om + offs_d[None, :] * stride_ok, acc.to(Out.type.element_ty),
             mask=offs_m[:, None] < N_CTX)


def attention(q, k, v, sm_scale, causal=False):
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(N, 64), B * H)
    _attn_fwd[grid](q, k, v, sm_scale, lse, o, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                    B, H, N, HEAD_DIM=D, BLOCK_M=64, BLOCK_N=32, IS_CAUSAL=causal)
    return o
'''

RENAMES = {"N_CTX": "n", "HEAD_DIM": "DH", "BLOCK_M": "TQ", "BLOCK_N": "TK"}


def _lift(tmp_path: Path, text: str, name: str = "mine.py") -> LiftReport:
    path = tmp_path / name
    path.write_text(text)
    return lift_file(path, Provenance("local", "0", name, 1, 1, "triton", ""), "local_triton")


def _renamed(text: str) -> str:
    text = text.replace("tl.trans(k)", "k.T")
    for old, new in RENAMES.items():
        text = re.sub(rf"\b{old}\b", new, text)
    return text


def test_tutorial_style_forward_lifts_and_verifies(tmp_path: Path) -> None:
    rep = _lift(tmp_path, TUTORIAL)
    assert sorted(p.name for p in rep.programs) == ["local_triton_attn_fwd", "local_triton_attn_fwd_is_causal"], \
        rep.skipped
    for p in rep.programs:
        assert p.verified and "interpreter == dense torch" in p.verify_note, p.verify_note
    causal = next(p for p in rep.programs if p.name.endswith("_is_causal"))
    assert str(causal.program.mask_mod.body) == "q_idx >= kv_idx"
    assert (causal.program.schedule.block_m, causal.program.schedule.block_n) == (64, 32)  # launch constants


def test_renamed_parameters_lift_to_the_same_program(tmp_path: Path) -> None:
    text = _renamed(TUTORIAL)
    assert "N_CTX" not in text and "BLOCK_M" not in text and "HEAD_DIM" not in text and "k.T" in text
    first, second = _lift(tmp_path, TUTORIAL), _lift(tmp_path, text, "renamed.py")
    assert len(second.programs) == 2 and all(p.verified for p in second.programs), second.skipped
    for a, b in zip(sorted(first.programs, key=lambda p: p.name), sorted(second.programs, key=lambda p: p.name)):
        assert a.program.kernels == b.program.kernels and a.program.mask_mod == b.program.mask_mod
