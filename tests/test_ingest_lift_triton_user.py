"""The Triton lifter on kernels written the way users write them: parameters are recognised by use, not by name."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from ingest.lift_triton import lift_file
from ingest.lift_verify import resolved_let
from ingest.model import LiftReport, Provenance
from kb.ir.text import print_program

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


# Roles by use: nothing is named like the tutorial (strides s_*, counts n_*, sizes DIM/BM/BN, scale `scale`),
# the fused batch*head axis is split by the head count, and the launch configures the blocks by keyword.
RENAMED = '''\
import triton
import triton.language as tl


@triton.jit
def fwd(Q, K, V, scale, L, Out,
        s_q0, s_q1, s_q2, s_q3, s_k0, s_k1, s_k2, s_k3, s_v0, s_v1, s_v2, s_v3, s_o0, s_o1, s_o2, s_o3,
        n_batch, n_heads, seq,
        DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr):
    pm = tl.program_id(axis=0)
    bh = tl.program_id(axis=1)
    bi = bh // n_heads
    hi_ = bh % n_heads
    rows = pm * BM + tl.arange(0, BM)
    cols0 = tl.arange(0, BN)
    dd = tl.arange(0, DIM)
    q = tl.load(Q + bi * s_q0 + hi_ * s_q1 + rows[:, None] * s_q2 + dd[None, :] * s_q3, mask=rows[:, None] < seq, other=0.0)
    mx = tl.full([BM], float("-inf"), tl.float32)
    den = tl.full([BM], 1.0, tl.float32)
    o = tl.zeros([BM, DIM], tl.float32)
    c = scale * 1.44269504
    hi = seq
    if CAUSAL:
        hi = tl.minimum((pm + 1) * BM, seq)
    for j in range(0, hi, BN):
        cols = j + cols0
        kt = tl.load(K + bi * s_k0 + hi_ * s_k1 + cols[:, None] * s_k2 + dd[None, :] * s_k3, mask=cols[:, None] < seq, other=0.0)
        s = tl.dot(q, kt.T)
        s = tl.where(cols[None, :] < seq, s, float("-inf"))
        if CAUSAL:
            s = tl.where(rows[:, None] >= cols[None, :], s, float("-inf"))
        mnew = tl.maximum(mx, tl.max(s, 1) * c)
        s = s * c - mnew[:, None]
        p = tl.math.exp2(s)
        a = tl.math.exp2(mx - mnew)
        den = den * a + tl.sum(p, 1)
        o = o * a[:, None]
        vt = tl.load(V + bi * s_v0 + hi_ * s_v1 + cols[:, None] * s_v2 + dd[None, :] * s_v3, mask=cols[:, None] < seq, other=0.0)
        o = tl.dot(p.to(tl.float16), vt, o)
        mx = mnew
    tl.store(L + bh * seq + rows, (mx + tl.math.log2(den)) / 1.44269504, mask=rows < seq)
    o = o / den[:, None]
    tl.store(Out + bi * s_o0 + hi_ * s_o1 + rows[:, None] * s_o2 + dd[None, :] * s_o3, o.to(tl.float16), mask=rows[:, None] < seq)


def run(q, k, v, scale, causal=False):
    b, h, n, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    fwd[(triton.cdiv(n, 64), b * h)](q, k, v, scale, lse, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                                     b, h, n, DIM=d, BM=64, BN=32, CAUSAL=causal)
    return out
'''

# Block pointers: K is described transposed ([DIM, seq] with swapped strides) and used as tl.dot(q, k);
# the pointers move with tl.advance; loads are bounds-checked with zero padding.
BLOCK_PTR = '''\
import triton
import triton.language as tl


@triton.jit
def bp_fwd(Q, K, V, sm_scale, Lse, Out,
           stride_qz, stride_qh, stride_qm, stride_qk, stride_kz, stride_kh, stride_kn, stride_kk,
           stride_vz, stride_vh, stride_vn, stride_vk, stride_oz, stride_oh, stride_om, stride_ok,
           H, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    q_base = Q + off_z * stride_qz + off_h * stride_qh
    Q_bp = tl.make_block_ptr(base=q_base, shape=(N_CTX, HEAD_DIM), strides=(stride_qm, stride_qk),
                             offsets=(start_m * BLOCK_M, 0), block_shape=(BLOCK_M, HEAD_DIM), order=(1, 0))
    K_bp = tl.make_block_ptr(base=K + off_z * stride_kz + off_h * stride_kh, shape=(HEAD_DIM, N_CTX),
                             strides=(stride_kk, stride_kn), offsets=(0, 0), block_shape=(HEAD_DIM, BLOCK_N), order=(0, 1))
    V_bp = tl.make_block_ptr(base=V + off_z * stride_vz + off_h * stride_vh, shape=(N_CTX, HEAD_DIM),
                             strides=(stride_vn, stride_vk), offsets=(0, 0), block_shape=(BLOCK_N, HEAD_DIM), order=(1, 0))
    O_bp = tl.make_block_ptr(base=Out + off_z * stride_oz + off_h * stride_oh, shape=(N_CTX, HEAD_DIM),
                             strides=(stride_om, stride_ok), offsets=(start_m * BLOCK_M, 0),
                             block_shape=(BLOCK_M, HEAD_DIM), order=(1, 0))
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q_bp, boundary_check=(0, 1), padding_option="zero")
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.44269504
    if IS_CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_CTX)
    else:
        hi = N_CTX
    for start_n in tl.range(0, hi, BLOCK_N):
        k = tl.load(K_bp, boundary_check=(0, 1), padding_option="zero")
        qk = tl.dot(q, k) * qk_scale
        qk = tl.where((start_n + offs_n)[None, :] < N_CTX, qk, float("-inf"))
        if IS_CAUSAL:
            qk = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(V_bp, boundary_check=(0, 1), padding_option="zero")
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
        K_bp = tl.advance(K_bp, (0, BLOCK_N))
        V_bp = tl.advance(V_bp, (BLOCK_N, 0))
    acc = acc / l_i[:, None]
    tl.store(Lse + off_hz * N_CTX + offs_m, (m_i + tl.math.log2(l_i)) / 1.44269504, mask=offs_m < N_CTX)
    tl.store(O_bp, acc.to(Out.type.element_ty), boundary_check=(0, 1))
'''

# Tensor descriptors over a flattened [batch * heads * seq, DIM] view; the row offset is computed from
# batch, head and position; an RCP_LN2 module constant folds log2(e) into the scale.
DESCRIPTOR = '''\
import triton
import triton.language as tl

RCP_LN2: tl.constexpr = 1.4426950408889634


@triton.jit
def desc_fwd(sm_scale, Lse, Q, K, V, Out, Z, H, N_CTX,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    rows_total = Z * H * N_CTX
    dq = tl.make_tensor_descriptor(Q, shape=[rows_total, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM])
    dk = tl.make_tensor_descriptor(K, shape=[rows_total, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
    dv = tl.make_tensor_descriptor(V, shape=[rows_total, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
    do = tl.make_tensor_descriptor(Out, shape=[rows_total, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM])
    row0 = off_z * (N_CTX * H) + off_h * N_CTX
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = dq.load([row0 + start_m * BLOCK_M, 0])
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * RCP_LN2
    hi = N_CTX
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_CTX)
    for start_n in tl.range(0, hi, BLOCK_N, num_stages=2):
        k = dk.load([row0 + start_n, 0])
        qk = tl.dot(q, k.T)
        qk = tl.where((start_n + offs_n)[None, :] < N_CTX, qk, float("-inf"))
        if CAUSAL:
            qk = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = dv.load([row0 + start_n, 0])
        acc = tl.dot(p.to(tl.float16), v, acc)
        m_i = m_ij
    acc = acc / l_i[:, None]
    tl.store(Lse + off_hz * N_CTX + offs_m, (m_i + tl.math.log2(l_i)) / RCP_LN2, mask=offs_m < N_CTX)
    do.store([row0 + start_m * BLOCK_M, 0], acc.to(tl.float16))
'''

# Autotune and heuristics stacked on the jit: configs are tunables, the heuristic flag is a constexpr
# like any other; the scale is folded with a module-level LOG2E before the row max; the KV head is
# the q head divided by the group size (GQA), and the grid has one axis each for head and batch.
AUTOTUNED_GQA = '''\
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.autotune(configs=[triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
                          triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)],
                 key=["seqlen_q", "seqlen_k", "HEAD_DIM"])
@triton.heuristics({"EVEN_N": lambda args: args["seqlen_k"] % args["BLOCK_N"] == 0})
@triton.jit
def gqa_fwd(Q, K, V, Out, Lse, softmax_scale,
            sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
            nheads, nheads_kv, seqlen_q, seqlen_k,
            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            EVEN_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    kv_head = head // (nheads // nheads_kv)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + batch * sqb + head * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=offs_m[:, None] < seqlen_q, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = softmax_scale * LOG2E
    end = seqlen_k
    if IS_CAUSAL:
        end = tl.minimum((pid_m + 1) * BLOCK_M, seqlen_k)
    for start_n in range(0, end, BLOCK_N):
        offs_kv = start_n + offs_n
        if EVEN_N:
            k = tl.load(K + batch * skb + kv_head * skh + offs_kv[:, None] * skn + offs_d[None, :])
        else:
            k = tl.load(K + batch * skb + kv_head * skh + offs_kv[:, None] * skn + offs_d[None, :],
                        mask=offs_kv[:, None] < seqlen_k, other=0.0)
        qk = tl.dot(q, tl.trans(k))
        qk = qk * qk_scale
        if not EVEN_N:
            qk = tl.where(offs_kv[None, :] < seqlen_k, qk, float("-inf"))
        if IS_CAUSAL:
            qk = tl.where(offs_m[:, None] >= offs_kv[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(V + batch * svb + kv_head * svh + offs_kv[:, None] * svn + offs_d[None, :],
                    mask=offs_kv[:, None] < seqlen_k, other=0.0)
        acc += tl.dot(p.to(tl.float16), v)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(Lse + (batch * nheads + head) * seqlen_q + offs_m, (m_i + tl.math.log2(l_i)) / LOG2E,
             mask=offs_m < seqlen_q)
    tl.store(Out + batch * sob + head * soh + offs_m[:, None] * som + offs_d[None, :], acc.to(tl.float16),
             mask=offs_m[:, None] < seqlen_q)
'''


def _text_of(p) -> str:
    return print_program(replace(p.program, name="x"))


def _check_causal_pair(rep: LiftReport, suffix: str) -> None:
    assert len(rep.programs) == 2 and all(p.verified for p in rep.programs), rep.skipped
    for p in rep.programs:
        assert "interpreter == dense torch" in p.verify_note, p.verify_note
    causal = next(p for p in rep.programs if p.name.endswith(suffix))
    assert str(causal.program.mask_mod.body) == "q_idx >= kv_idx"
    other = next(p for p in rep.programs if not p.name.endswith(suffix))
    assert other.program.mask_mod is None


def test_roles_and_sizes_by_use_lift_to_the_tutorial_program(tmp_path: Path) -> None:
    mine, tutorial = _lift(tmp_path, RENAMED, "renamed_roles.py"), _lift(tmp_path, TUTORIAL)
    _check_causal_pair(mine, "_causal")
    by_name = lambda rep: sorted(rep.programs, key=lambda p: p.name)  # noqa: E731
    for a, b in zip(by_name(mine), by_name(tutorial)):
        assert _text_of(a) == _text_of(b)


def test_block_pointers_with_a_transposed_k(tmp_path: Path) -> None:
    rep = _lift(tmp_path, BLOCK_PTR, "block_ptr.py")
    _check_causal_pair(rep, "_is_causal")


def test_tensor_descriptors_over_flattened_rows(tmp_path: Path) -> None:
    rep = _lift(tmp_path, DESCRIPTOR, "descriptor.py")
    _check_causal_pair(rep, "_causal")
    assert any("flattened" in n for p in rep.programs for n in p.notes)


def test_autotune_heuristics_and_gqa(tmp_path: Path) -> None:
    rep = _lift(tmp_path, AUTOTUNED_GQA, "autotuned.py")
    _check_causal_pair(rep, "_is_causal")
    for p in rep.programs:
        assert "h // (Hq // Hkv)" in str(resolved_let(p.program.kernels[0].body, "hk"))
        assert "Hkv=2" in p.verify_note  # verified with grouped heads
        s = p.program.schedule
        assert (s.block_m, s.block_n, s.num_warps, s.num_stages) == (64, 32, 4, 2)  # the first config
        assert sorted(t.params["block_m"] for t in p.tunables) == [64, 128]


def test_a_feature_flag_is_found_by_use_whatever_its_name(tmp_path: Path) -> None:
    # `if masked:` switches the causal mask; no name rule knows `masked`, its use as an `if` test does
    text = re.sub(r"\bIS_CAUSAL\b", "masked", TUTORIAL)
    rep = _lift(tmp_path, text)
    assert sorted(p.name for p in rep.programs) == ["local_triton_attn_fwd", "local_triton_attn_fwd_masked"], rep.skipped
    flagged = next(p for p in rep.programs if p.name.endswith("_masked"))
    assert flagged.verified and flagged.features.causal and str(flagged.program.mask_mod.body) == "q_idx >= kv_idx"
