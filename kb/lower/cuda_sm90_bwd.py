"""Hopper (sm_90a) attention backward: the FA3-structured kernel that follows the forward template's hooks.

`sm90_backward_source(head_dim_pad=, dtype=)` returns CUDA C++ appended to the translation unit of
kb.lower.cuda_sm90 (it uses that file's `kb90` helpers: mbarriers, TMA, descriptors, wgmma wrappers,
and its four variant hooks, unchanged). Given q, k, v, o, dout and the forward's lse it computes
  dv = P^T dO,  dk = dS^T Q * sm_scale,  dq = dS K * sm_scale,  dS = P * (dP - rowsum(dO * O)),
for scores whose derivative in the raw q.k is sm_scale wherever they are not masked (a score_mod
that only adds terms, masks); kb.lower.cuda_sm90_ir decides which programs qualify.

Kernel shape (one CTA of two warpgroups per (key tile of 128 rows, kv head, batch), causal-heaviest first):
- every step's kind (skip / per element / scale only, the forward's `kb_block_kind` for the enclosing
  forward tile) is computed once per CTA by all its threads into shared memory; K and V are loaded once
  by TMA; thread 0 streams the (Q, dO, lse2, delta) of BQ query rows (64 at D=128, 128 at D=64:
  `bwd_block_q`) into a 2-stage ring one step
  ahead (as soon as the stage is free, at the latest after the step's dS barrier), for every query head
  of the GQA group and every query tile not skipped, so dK and dV of a kv head are summed in registers
  over its whole group (no atomics, deterministic). No producer warpgroup: the consumers need ~250
  registers at D=128, above what `setmaxnreg` leaves beside one;
- warpgroups 1 and 2 own 64 key rows each. Per query tile: S^T = K Q^T and dP^T = V dO^T with
  `wgmma m64nBQk16` (both operands K-major from shared memory), issued together; P^T = exp2(score *
  log2 e - lse * log2 e) on the accumulator while dP^T is in flight (branch-free where the step's kind
  says every score is s * sm_scale, through the forward's hooks where the tile is partial); dV += P^T dO
  issued before dS^T = P^T (dP^T - delta) is computed, then dK += dS^T Q, with the 16-bit P^T and dS^T
  as register A operands (the accumulator layout is the A-fragment layout) and dO, Q read MN-major;
  (at BQ = 128 dS is computed before dV is issued: P, dP and dS beside P^T in flight would not fit the
  registers); dS^T is stored 128B-swizzled into one of two buffers, both warpgroups meet at one barrier, and
  each computes dQ = dS K over all 128 keys for half the head dim at BQ = 64 (FA3's split), for 64 of the
  queries at BQ = 128, both operands MN-major
  ("transposed"), staged in shared memory and added to an fp32 buffer by a TMA bulk reduction
  (`cp.reduce.async.bulk`; no per-element atomics, one reduction per dQ element per step);
- before: a kernel computes delta = rowsum(dO * O) (O in fp32 or 16-bit) and lse * log2 e (+inf for
  an empty row or a padded one, so that its P is 0); after: dq = dq_acc * sm_scale in q's type.

Host side: `extern "C" int kb_sm90_bwd_launch(const KbArgs*, KbBwdArgs*, void* stream)` (it sets M_pad); codes of
kb.lower.cuda_sm90's ERROR_CODES (the same rules: D, TMA strides) or a cudaError_t.
"""

from __future__ import annotations

from kb.lower.cuda_sm90 import _ELEM, _wgmma_rs, _wgmma_ss

__all__ = ["sm90_backward_source", "bwd_block_q", "BWD_PAD_Q", "BWD_BLOCK_KV", "BWD_LAUNCH_SYMBOL", "bwd_smem_bytes"]

# kb.lower.cuda_sm90_ir's host entry: kb_launch's arguments, then void* gptrs[8] = (o, dout, dq, dk, dv, dq_acc,
# delta, lse2), long long gstrides[20] = the strides of o, dout, dq, dk, dv, and int o_f32; the scratch dq_acc is
# [B, Hq, M_pad, D] fp32, delta and lse2 [B, Hq, M_pad] fp32, M_pad = M rounded up to BWD_PAD_Q.
BWD_LAUNCH_SYMBOL = "kb_launch_bwd"
BWD_PAD_Q = 128  # a multiple of every head dim's query tile
BWD_BLOCK_KV = 128
KIND_CAP = 16384  # (query head, query tile) steps per key tile whose kind a CTA keeps in shared memory


def bwd_block_q(head_dim_pad: int) -> int:
    """Query rows per step: 64 at D=128 (dK, dV, S and dP fill the registers), 128 at D=64 (FA3's tile there: half
    the steps, so half the per-step waits, barriers and bulk reductions for the same tensor-core work)."""
    return 128 if head_dim_pad == 64 else 64


def _dq_n(head_dim_pad: int) -> int:
    """dQ columns per warpgroup (the kernel's DQ_N): half the head dim at 64 query rows per step, all at 128."""
    return head_dim_pad // 2 if bwd_block_q(head_dim_pad) == 64 else head_dim_pad


def bwd_smem_bytes(head_dim_pad: int) -> int:
    """K, V, two (Q, dO, lse2, delta) stages, two dS^T buffers, the dQ staging panels, the step kinds, barriers,
    alignment."""
    bq = bwd_block_q(head_dim_pad)
    kv = BWD_BLOCK_KV * head_dim_pad * 2
    q = bq * head_dim_pad * 2
    ds = 2 * BWD_BLOCK_KV * bq * 2
    dq_panels = 2 * 64 * _dq_n(head_dim_pad) * 4  # each warpgroup's fp32 part of dQ: 64 queries x DQ_N
    rows = 2 * 2 * bq * 4  # per stage: lse2 and delta
    return 2 * kv + 2 * 2 * q + ds + dq_panels + rows + KIND_CAP // 4 + 128 + 1024


def _wgmma_ss_tt(n: int, ab: str) -> str:
    """D[64 x n] (+)= A[64 x 16] B[16 x n], both MN-major in shared memory (imm-trans-a = imm-trans-b = 1)."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return f"""\
#ifndef KB_WGMMA_SS_TT_N{n}
#define KB_WGMMA_SS_TT_N{n}
// dQ-type GEMM: A = dS (its M axis, the query, contiguous) and B = K (its N axis, the head dim,
// contiguous), both 128B-swizzled MN-major tiles; scale_d = 0 overwrites d.
__device__ __forceinline__ void kb_wgmma_ss_tt_n{n}(float (&d)[{regs}], uint64_t desc_a, uint64_t desc_b, int scale_d) {{
  asm volatile(
    "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"
    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} "
    "{{{outs}}}, %{regs}, %{regs + 1}, p, 1, 1, 1, 1;\\n}}\\n"
    : {cons}
    : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}}
#endif
"""


_BWD = r"""
// ---- generated by kb.lower.cuda_sm90_bwd: Hopper (sm_90a) attention backward ----
struct KbBwdArgs {
  const void* o; long long o_stride[4]; int o_f32;  // the forward's output: fp32 or q's type
  const kb_elem* dout; long long do_stride[4];
  kb_elem *dq, *dk, *dv; long long dq_stride[4], dk_stride[4], dv_stride[4];
  float *dq_acc, *delta, *lse2;  // [B, Hq, M_pad, D], [B, Hq, M_pad] x 2 (scratch)
  long long M_pad;
};

namespace kb90b {
using namespace kb90;

constexpr int BQ = @BQ@;                 // query rows per step
constexpr int PAD_Q = @PADQ@;             // M_pad: M rounded up to it (kb.lower.cuda_sm90_bwd.BWD_PAD_Q)
constexpr int BK = @BK@;                 // key rows per CTA: 2 consumer warpgroups x 64
constexpr int QT_PANEL = BQ * 128;       // bytes of one 64-column panel of a Q or dO tile
constexpr int KT_PANEL = BK * 128;       // of a K or V tile
constexpr int QT_BYTES = NPANEL * QT_PANEL;
constexpr int KT_BYTES = NPANEL * KT_PANEL;
constexpr int BSTAGES = 2;
constexpr int DS_PANEL = BK * 128;       // dS^T: BK rows of 64 queries' 16-bit values (one 128-byte swizzle row)
constexpr int DS_BYTES = BQ / 64 * DS_PANEL;  // one of its two buffers
// dQ of a step = dS K, split between the warpgroups: at BQ = 64 by head dim (warpgroup cw computes all 64 queries x
// columns [cw * DQ_N, (cw + 1) * DQ_N)), at BQ = 128 by query (queries [64 cw, 64 cw + 64) x all HD columns)
constexpr int DQ_N = @DQN@;  // kb.lower.cuda_sm90_bwd._dq_n
constexpr int DQ_TILE = 64 * DQ_N * 4;   // a warpgroup's staged fp32 dQ: 64 queries x DQ_N columns
constexpr int OFF_V = KT_BYTES;
constexpr int OFF_Q = 2 * KT_BYTES;
constexpr int OFF_DO = OFF_Q + BSTAGES * QT_BYTES;
constexpr int OFF_DS = OFF_DO + BSTAGES * QT_BYTES;
constexpr int OFF_DQ = OFF_DS + 2 * DS_BYTES;
constexpr int ROW_BYTES = BQ * 4;        // one step's lse2 or delta: BQ fp32
constexpr int OFF_ROWS = OFF_DQ + 2 * DQ_TILE;  // per stage: lse2 then delta
constexpr int KIND_CAP = @KIND_CAP@;      // steps whose kind the CTA keeps (2 bits each); later ones are computed
constexpr int OFF_KIND = OFF_ROWS + BSTAGES * 2 * ROW_BYTES;
constexpr int OFF_BAR = OFF_KIND + KIND_CAP / 4;
constexpr int SMEM_BYTES = OFF_BAR + 128 + 1024;
constexpr int BAR_WG = 1;                // named barriers 1 and 2: the four warps of consumer warpgroup 0 or 1
constexpr int BAR_DS = 3;                // 3: both warpgroups (dS^T of all 128 keys is in shared memory)
static_assert((BQ == 64 || (BQ == 128 && HD == 64)) && BK == 128 && HD % 64 == 0, "tile shape");
static_assert(SMEM_BYTES == @SMEM@, "kb.lower.cuda_sm90_bwd.bwd_smem_bytes");

struct BSmem {
  uint32_t base;
  __device__ uint32_t k() const { return base; }
  __device__ uint32_t v() const { return base + OFF_V; }
  __device__ uint32_t q(int s) const { return base + OFF_Q + s * QT_BYTES; }
  __device__ uint32_t dout(int s) const { return base + OFF_DO + s * QT_BYTES; }
  __device__ uint32_t ds(int buf) const { return base + OFF_DS + buf * DS_BYTES; }
  __device__ uint32_t dq(int wg) const { return base + OFF_DQ + wg * DQ_TILE; }
  __device__ uint32_t lse2(int s) const { return base + OFF_ROWS + s * 2 * ROW_BYTES; }
  __device__ uint32_t delta(int s) const { return lse2(s) + ROW_BYTES; }
  __device__ uint32_t kinds() const { return base + OFF_KIND; }
  __device__ uint32_t bar_kv() const { return base + OFF_BAR; }
  __device__ uint32_t full(int s) const { return base + OFF_BAR + 8 * (1 + s); }
  __device__ uint32_t empty(int s) const { return base + OFF_BAR + 8 * (1 + BSTAGES + s); }
};

// Bulk reduction (the TMA unit adds a shared-memory tile to global memory), and waits on this thread's bulk groups.
__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32_t src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(dst), "r"(src), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ bool mbar_ready(uint32_t bar, uint32_t parity) {  // never blocks
  uint32_t done;
  asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}

__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ float2 lds_f2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// A descriptor moved `bytes` further in shared memory: its start-address field (bits 0-13, address >> 4) never
// carries, since shared addresses stay below 2^18. One add per k-step instead of a descriptor built per wgmma.
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }
// K-major 128B-swizzled operand (see kb90::desc_kmajor): k-step kk is 32 B into its panel, panel kk / 4.
__device__ __forceinline__ uint32_t kmajor_off(int panel_bytes, int kk) { return (kk / 4) * panel_bytes + (kk % 4) * 32; }
// MN-major 128B-swizzled operand (see kb90::desc_v): k-step kk starts 16 rows = 2048 B further;
// the next 64 columns are one panel (LBO) away.
__device__ __forceinline__ uint64_t desc_mn(uint32_t tile, int panel_bytes) { return make_desc(tile, panel_bytes, 1024); }

struct BTile {  // the CTA's key tile and the query heads whose gradients it collects (the launcher bounds them to int)
  int b, hk, h0, group, n_start, nmb;
};

__device__ __forceinline__ BTile make_btile(const KbArgs& a) {
  BTile t;
  t.b = blockIdx.z;
  t.hk = blockIdx.y;
  t.group = static_cast<int>(a.Hq / a.Hkv);
  t.h0 = t.hk * t.group;
  t.n_start = blockIdx.x * BK;
  t.nmb = static_cast<int>((a.M + BQ - 1) / BQ);
  return t;
}

// The forward's hooks decide which (query tile, key tile) pairs contribute: its tiles are
// KB_BLOCK_M x KB_BLOCK_N and this kernel's 64 query rows lie in one of them, so the enclosing
// tile's kind is exact for them (0: skipped, 2: s * sm_scale everywhere, 1: per element).
__device__ __forceinline__ int step_kind(const KbArgs& a, const BTile& t, int h, int m0) {
  const long long fm = (m0 / KB_BLOCK_M) * KB_BLOCK_M;
  long long lo, hi;
  kb_kv_range(a, t.b, h, fm, lo, hi);
  if (lo < 0) lo = 0;
  if (lo < hi && lo % KB_BLOCK_N != 0) __trap();  // the forward's key tiles are off this kernel's grid
  return kb_block_kind(a, t.b, h, fm, t.n_start);
}

// Every (query head, query tile) step's kind, 2 bits each, computed once per CTA by all its threads in parallel (the
// hooks may read a block-class table from global memory: scanning them per step and per thread would cost more than
// the steps of a narrow window); steps past KIND_CAP are asked of the hooks as they come.
__device__ __forceinline__ void fill_kinds(const KbArgs& a, const BTile& t, const BSmem& sm, int tid) {
  const int total = t.group * t.nmb, bytes = min(total, KIND_CAP) / 4 + 1;
  for (int j = tid; j < bytes && j < KIND_CAP / 4; j += 256) {
    uint32_t packed = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int idx = 4 * j + e;
      if (idx < total) packed |= static_cast<uint32_t>(step_kind(a, t, t.h0 + idx / t.nmb, (idx % t.nmb) * BQ)) << (2 * e);
    }
    asm volatile("st.shared.u8 [%0], %1;" :: "r"(sm.kinds() + j), "r"(packed) : "memory");
  }
}

struct Walk {  // the steps that contribute to the key tile, in order: step idx is head h0 + idx / nmb, tile idx % nmb
  int idx, kind;
  __device__ __forceinline__ int h(const BTile& t) const { return t.h0 + idx / t.nmb; }
  __device__ __forceinline__ int m0(const BTile& t) const { return (idx % t.nmb) * BQ; }
  __device__ __forceinline__ bool next(const KbArgs& a, const BTile& t, const BSmem& sm) {
    const int total = t.group * t.nmb;
    while (++idx < total) {
      if (idx < KIND_CAP) {
        uint32_t packed;
        asm volatile("ld.shared.u8 %0, [%1];" : "=r"(packed) : "r"(sm.kinds() + (idx >> 2)));
        kind = (packed >> (2 * (idx & 3))) & 3;
      } else {
        kind = step_kind(a, t, h(t), m0(t));
      }
      if (kind != 0) return true;
    }
    return false;
  }
};

// One thread loads step `it`'s Q and dO tiles, lse2 and delta into stage it % 2 once every thread has released it.
__device__ __forceinline__ void load_step(const BSmem& sm, const BTile& t, const KbBwdArgs& g, long long M_pad, int it,
                                          const Walk& w, const CUtensorMap* mq, const CUtensorMap* mdo, long long Hq) {
  const int s = it % BSTAGES;
  mbar_wait(sm.empty(s), ((it / BSTAGES) & 1) ^ 1);
  mbar_expect_tx(sm.full(s), 2 * QT_BYTES + 2 * ROW_BYTES);
  const int h = w.h(t), m0 = w.m0(t);
#pragma unroll
  for (int p = 0; p < NPANEL; ++p) {
    tma_load_4d(sm.q(s) + p * QT_PANEL, mq, sm.full(s), p * 64, m0, h, t.b);
    tma_load_4d(sm.dout(s) + p * QT_PANEL, mdo, sm.full(s), p * 64, m0, h, t.b);
  }
  const long long row0 = (static_cast<long long>(t.b) * Hq + h) * M_pad + m0;  // 256-byte aligned: M_pad % 64 == 0
  bulk_load(sm.lse2(s), g.lse2 + row0, ROW_BYTES, sm.full(s));
  bulk_load(sm.delta(s), g.delta + row0, ROW_BYTES, sm.full(s));
}

// Thread 0's loads: step `it` goes into stage it % 2 once both warpgroups have released the step before it there.
struct LoadCursor {
  Walk w;     // the next step to load
  bool more;  // there is one
  int it;     // its index
};

// Accumulator element i of a m64nN wgmma tile sits at row 16*warp + lane/4 + 8*((i/2)%2) and
// column 8*(i/4) + 2*(lane%4) + i%2 of this warpgroup's 64 rows (rows: keys here, columns: queries).
struct BwdConsumer {
  const KbArgs& a;
  const KbBwdArgs& g;
  const BTile& t;
  const BSmem& sm;
  const CUtensorMap *mq, *mdo;
  LoadCursor ld;      // used by thread 0 only
  int cw, lane, warp;
  float dv[HD / 2], dk[HD / 2];

  __device__ BwdConsumer(const KbArgs& a_, const KbBwdArgs& g_, const BTile& t_, const BSmem& sm_,
                         const CUtensorMap* mq_, const CUtensorMap* mdo_, LoadCursor ld_, int cw_, int tid)
      : a(a_), g(g_), t(t_), sm(sm_), mq(mq_), mdo(mdo_), ld(ld_), cw(cw_) {
    lane = tid % 32;
    warp = tid / 32;
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) dv[i] = dk[i] = 0.f;
  }

  // Thread 0 loads step `upto` (the one after the step computed) once its stage is free; `block = false` returns
  // instead of waiting. The stage is free once both warpgroups finished the step before the one computed, which is
  // certain after this step's dS barrier, so the blocking call there never waits.
  __device__ __forceinline__ void poll(int upto, bool block) {
    if (threadIdx.x != 0 || !ld.more || ld.it > upto) return;
    const uint32_t empty = sm.empty(ld.it % BSTAGES), parity = ((ld.it / BSTAGES) & 1) ^ 1;
    if (!block && !mbar_ready(empty, parity)) return;
    load_step(sm, t, g, g.M_pad, ld.it, ld.w, mq, mdo, a.Hq);
    ld.more = ld.w.next(a, t, sm);
    ++ld.it;
  }

  // D[64 keys x BQ queries] = A[this warpgroup's 64 key rows] B[BQ query rows]^T, both K-major over the head dim.
  __device__ __forceinline__ void gemm_rows(float (&d)[BQ / 2], uint32_t a_tile, uint32_t b_tile) {
    const uint64_t da = make_desc(a_tile, 16, 1024), db = make_desc(b_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      kb_wgmma_ss_n@BQ@(d, desc_at(da, kmajor_off(KT_PANEL, kk)), desc_at(db, kmajor_off(QT_PANEL, kk)), kk > 0 ? 1 : 0);
  }

  // acc[64 keys x HD] += A[64 keys x BQ queries] (16-bit registers, the accumulator layout) B[BQ queries x HD] (MN-major).
  __device__ __forceinline__ void gemm_acc(float (&acc)[HD / 2], uint32_t (&afrag)[BQ / 4], uint32_t b_tile) {
    const uint64_t db = desc_mn(b_tile, QT_PANEL);
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) kb_wgmma_rs_n@HD@(acc, &afrag[4 * kk], desc_at(db, kk * 2048));
  }

  // 16-bit pairs of an accumulator: the A fragment of a register-operand wgmma.
  __device__ __forceinline__ static void pack(uint32_t (&out)[BQ / 4], const float (&x)[BQ / 2]) {
#pragma unroll
    for (int i = 0; i < BQ / 4; ++i) out[i] = pack2(x[2 * i], x[2 * i + 1]);
  }

  // dS^T = P^T (dP^T - delta), in place of dP^T; `delta` is this thread's first column's in the stage.
  __device__ __forceinline__ static void grad_scores(float (&dp)[BQ / 2], const float (&p)[BQ / 2], uint32_t delta) {
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j) {
      const float2 dl = lds_f2(delta + 32 * j);
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[4 * j + e] = p[4 * j + e] * (dp[4 * j + e] - (e % 2 ? dl.y : dl.x));
    }
  }

  __device__ __forceinline__ void step(int it, int h, int m0, int kind) {
    // An opaque copy of the shared-memory base: every descriptor below is then computed where it is used,
    // not hoisted out of the step loop into registers that the accumulators need.
    BSmem sm = this->sm;
    asm volatile("" : "+r"(sm.base));
    const int s = it % BSTAGES;
    poll(it + 1, false);
    mbar_wait(sm.full(s), (it / BSTAGES) & 1);
    float sacc[BQ / 2], dpacc[BQ / 2];
    wg_fence();
    gemm_rows(sacc, sm.k() + cw * 64 * 128, sm.q(s));  // S^T = K Q^T
    wg_commit();
    gemm_rows(dpacc, sm.v() + cw * 64 * 128, sm.dout(s));  // dP^T = V dO^T
    wg_commit();
    poll(it + 1, false);

    const long long row0 = (static_cast<long long>(t.b) * a.Hq + h) * g.M_pad + m0;  // this step's first dq_acc row
    const uint32_t lse2 = sm.lse2(s) + 8 * (lane % 4), delta = sm.delta(s) + 8 * (lane % 4);  // staged with Q and dO
    wg_wait<1>();
    reg_fence(sacc);
    const float scale2 = a.sm_scale * LOG2E;
    if (kind == 2 && t.n_start + BK <= a.N) {  // every score is s * sm_scale: P^T = exp2(s * scale2 - lse2)
#pragma unroll
      for (int j = 0; j < BQ / 8; ++j) {
        const float2 l = lds_f2(lse2 + 32 * j);  // columns 8j + 2(lane % 4) and the next
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[4 * j + e] = fast_exp2(fmaf(sacc[4 * j + e], scale2, -(e % 2 ? l.y : l.x)));
      }
    } else {
      // 32-bit indices: the launcher refuses M, N >= 2^31
      const int kv0 = t.n_start + 64 * cw + 16 * warp + lane / 4, q0 = m0 + 2 * (lane % 4);
      const int n_keys = static_cast<int>(a.N), m_rows = static_cast<int>(a.M);
      // the hooks' pieces of this step's head and of the thread's two keys once per step (ALiBi's slope, a key's
      // document id); a query's (kb_row_at) per element: a KbRow per column pair spills at D=128
      const KbRow head = kb_row_head(a, t.b, h);
      const KbCol col[2] = {kb_col(a, t.b, h, kv0), kb_col(a, t.b, h, kv0 + 8)};
#pragma unroll
      for (int j = 0; j < BQ / 8; ++j) {
        const float2 l = lds_f2(lse2 + 32 * j);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * j + e, kv = kv0 + 8 * (e / 2), q = q0 + 8 * j + (e % 2);
          float x;
          if (kv >= n_keys || q >= m_rows) x = -INFINITY;
          else if (kind == 2) x = sacc[i] * scale2;
          else x = kb_score_at(a, kb_row_at(a, head, q), col[e / 2], sacc[i]) * LOG2E;
          sacc[i] = fast_exp2(x - (e % 2 ? l.y : l.x));  // lse2 = +inf on empty and padded rows: P = 0
        }
      }
    }
    uint32_t pa[BQ / 4], dsa[BQ / 4];
    if constexpr (BQ == 64) {
      pack(pa, sacc);
      wg_fence();
      gemm_acc(dv, pa, sm.dout(s));  // dV += P^T dO, while dS is computed
      wg_commit();
      wg_wait<1>();
      reg_fence(dpacc);
      grad_scores(dpacc, sacc, delta);
    } else {  // 128 query rows: P, dP and dS beside P^T in flight would not fit the registers, so dS first
      wg_wait<0>();
      reg_fence(dpacc);
      grad_scores(dpacc, sacc, delta);
      pack(pa, sacc);
      wg_fence();
      gemm_acc(dv, pa, sm.dout(s));  // dV += P^T dO
      wg_commit();
    }
    pack(dsa, dpacc);
    wg_fence();
    gemm_acc(dk, dsa, sm.q(s));  // dK += dS^T Q, while dS^T goes to shared memory
    wg_commit();

    // This warpgroup's dS^T rows to shared memory in the 128B swizzle that wgmma reads: 16-byte chunk ^= row % 8.
    // Two buffers: the other warpgroup may still be reading the last step's in its dQ GEMM.
    const uint32_t dsb = sm.ds(it & 1);
#pragma unroll
    for (int j = 0; j < BQ / 4; ++j) {
      const int row = 64 * cw + 16 * warp + lane / 4 + 8 * (j % 2);
      const int col = 8 * (j / 2) % 64 + 2 * (lane % 4);  // in panel j / 16: queries 64 * (j / 16) ..
      const uint32_t addr = dsb + (j / 16) * DS_PANEL + row * 128 + ((((col * 2) >> 4) ^ (row % 8)) << 4) + ((col * 2) & 15);
      asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(dsa[j]) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> wgmma's reads
    const int wtid = 32 * warp + lane;
    if (wtid == 0) bulk_wait_read();  // this warpgroup's staged dQ of the last step has been read by its reduction
    named_sync(BAR_DS, 256);
    poll(it + 1, true);
    // dQ = dS K over all 128 keys of the tile, this warpgroup's part of it (DQ_N; FA3's split: one reduction per dQ
    // element per step, not one per warpgroup): queries qr0.. (dS^T panel qr0 / 64), columns c0.. of K, which start
    // (c0 % 64) * 2 bytes into panel c0 / 64: inside a 128-byte swizzle row, which the hardware swizzles as TMA wrote
    // it (the panel is 1024-aligned, no carry past bit 6). Staged in shared memory and added to dq_acc by one bulk
    // reduction. dq_acc keeps 64 x 64 tiles as an m64n64 accumulator holds them, value i of thread t at [i][t]
    // (kb_sm90_bwd_post undoes it): this warpgroup's values are i = (c0 % 64) / 2 .. + DQ_N / 2 of tile c0 / 64 of
    // rows qr0.., one contiguous block.
    const int c0 = BQ == 64 ? cw * DQ_N : 0, qr0 = BQ == 64 ? 0 : 64 * cw;
    float dq[DQ_N / 2];
    const uint64_t da = desc_mn(dsb + (qr0 / 64) * DS_PANEL, DS_PANEL);
    const uint64_t db = desc_mn(sm.k() + (c0 / 64) * KT_PANEL + (c0 % 64) * 2, KT_PANEL);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) kb_wgmma_ss_tt_n@DQN@(dq, desc_at(da, kk * 2048), desc_at(db, kk * 2048), kk > 0 ? 1 : 0);
    wg_commit();
    wg_wait<0>();
    reg_fence(dq);
    const uint32_t buf = sm.dq(cw);
#pragma unroll
    for (int i = 0; i < DQ_N / 2; ++i)
      asm volatile("st.shared.f32 [%0], %1;" :: "r"(buf + (i * 128 + wtid) * 4), "f"(dq[i]) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    named_sync(BAR_WG + cw, 128);
    if (wtid == 0) bulk_reduce_add(g.dq_acc + (row0 + qr0) * HD + (c0 / 64) * 4096 + (c0 % 64) / 2 * 128, buf, DQ_TILE);
    reg_fence(dv);
    reg_fence(dk);
    reg_fence(pa);
    reg_fence(dsa);
    mbar_arrive(sm.empty(s));  // dV and dK have read this stage's Q and dO
  }

  __device__ __forceinline__ void finish() {
    if (32 * warp + lane == 0) bulk_wait_all();  // the CTA must not exit under a bulk reduction's read
    epilogue();
  }

  __device__ __forceinline__ void epilogue() {
    const long long hk = t.hk;
    kb_elem* dvb = g.dv + t.b * g.dv_stride[0] + hk * g.dv_stride[1];
    kb_elem* dkb = g.dk + t.b * g.dk_stride[0] + hk * g.dk_stride[1];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const long long kv = t.n_start + 64 * cw + 16 * warp + lane / 4 + 8 * r;
      if (kv >= a.N) continue;
#pragma unroll
      for (int c = 0; c < HD / 8; ++c) {
        const int col = 8 * c + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(dvb + kv * g.dv_stride[2] + col) = pack2(dv[4 * c + 2 * r], dv[4 * c + 2 * r + 1]);
        *reinterpret_cast<uint32_t*>(dkb + kv * g.dk_stride[2] + col) =
            pack2(dk[4 * c + 2 * r] * a.sm_scale, dk[4 * c + 2 * r + 1] * a.sm_scale);
      }
    }
  }
};

// delta = rowsum(dO * O) and lse2 = lse * log2 e per (b, h, row < M_pad). Grid (row blocks, Hq, B): no 64-bit
// division; HD / 8 threads per row, each 8 columns (16 bytes of dO; the launcher checked O's and dO's alignment).
__global__ void kb_sm90_bwd_pre(const KbArgs a, const KbBwdArgs g) {
  constexpr int TPR = HD / 8;
  const long long h = blockIdx.y, b = blockIdx.z;
  const long long row = static_cast<long long>(blockIdx.x) * (blockDim.x / TPR) + threadIdx.x / TPR;
  const int d0 = (threadIdx.x % TPR) * 8;
  float acc = 0.f, l = -INFINITY;
  if (row < a.M) {
    const uint4 d4 = *reinterpret_cast<const uint4*>(g.dout + b * g.do_stride[0] + h * g.do_stride[1] + row * g.do_stride[2] + d0);
    const kb_elem* dx = reinterpret_cast<const kb_elem*>(&d4);
    const long long oo = b * g.o_stride[0] + h * g.o_stride[1] + row * g.o_stride[2] + d0;
    if (g.o_f32) {
      const float4* op = reinterpret_cast<const float4*>(static_cast<const float*>(g.o) + oo);
      const float4 o0 = op[0], o1 = op[1];
      acc = o0.x * static_cast<float>(dx[0]) + o0.y * static_cast<float>(dx[1]) + o0.z * static_cast<float>(dx[2]) +
            o0.w * static_cast<float>(dx[3]) + o1.x * static_cast<float>(dx[4]) + o1.y * static_cast<float>(dx[5]) +
            o1.z * static_cast<float>(dx[6]) + o1.w * static_cast<float>(dx[7]);
    } else {
      const uint4 o4 = *reinterpret_cast<const uint4*>(static_cast<const kb_elem*>(g.o) + oo);
      const kb_elem* ox = reinterpret_cast<const kb_elem*>(&o4);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += static_cast<float>(ox[e]) * static_cast<float>(dx[e]);
    }
    l = a.lse[b * a.lse_stride[0] + h * a.lse_stride[1] + row * a.lse_stride[2]];
  }
#pragma unroll
  for (int off = TPR / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (row < g.M_pad && d0 == 0) {
    const long long w = (b * a.Hq + h) * g.M_pad + row;
    g.delta[w] = acc;
    g.lse2[w] = l == -INFINITY ? INFINITY : l * LOG2E;
  }
}

// dq = dq_acc * sm_scale in q's type. dq_acc holds 64 x 64 tiles as the consumer warpgroups staged them: value i
// of thread t (the m64n64 accumulator layout) at [i][t], i.e. row 16 (t / 32) + (t % 32) / 4 + 8 ((i / 2) % 2), column
// 8 (i / 4) + 2 (t % 4) + i % 2. A thread reads [i][t0 .. t0 + 3] and [i + 1][t0 .. t0 + 3] (i even, t0 % 4 == 0: a warp
// reads 2 x 512 contiguous bytes) and writes the 8 consecutive columns of one row they hold. kb_post_at is thread p's
// part (host-callable: tests/test_lower_cuda_sm90_bwd.py runs it on the CPU): the dq_acc offset of [i][t0] (`src`;
// [i + 1][t0] is 128 floats on), the (b * Hq + h, row, first column) it writes, and whether it writes at all (p inside
// the grid, row < M).
struct KbPostAt {
  long long src, bh, row, col;
  bool live;
};
__host__ __device__ __forceinline__ KbPostAt kb_post_at(long long p, long long BH, long long M, long long M_pad) {
  KbPostAt r{};
  const long long tiles = BH * (M_pad / 64) * (HD / 64);
  if (p >= tiles * 512) return r;
  const long long tile = p / 512;
  const int rem = static_cast<int>(p % 512), i = 2 * (rem / 32), t0 = 4 * (rem % 32);
  const long long ct = tile % (HD / 64), rb = tile / (HD / 64);  // column tile; row block over (b, h, M_pad / 64)
  r.bh = rb / (M_pad / 64);
  r.row = (rb % (M_pad / 64)) * 64 + 16 * (t0 / 32) + (t0 % 32) / 4 + 8 * ((i / 2) % 2);
  r.col = ct * 64 + 8 * (i / 4);
  r.src = (r.bh * M_pad + (r.row / 64) * 64) * HD + ct * 4096 + i * 128 + t0;
  r.live = r.row < M;
  return r;
}

__global__ void kb_sm90_bwd_post(const KbArgs a, const KbBwdArgs g) {
  const KbPostAt at = kb_post_at(static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x, a.B * a.Hq, a.M, g.M_pad);
  if (!at.live) return;
  const float* src = g.dq_acc + at.src;
  const float4 ev = *reinterpret_cast<const float4*>(src), od = *reinterpret_cast<const float4*>(src + 128);
  const long long h = at.bh % a.Hq, b = at.bh / a.Hq, row = at.row, col = at.col;
  uint4 out;
  out.x = pack2(ev.x * a.sm_scale, od.x * a.sm_scale);
  out.y = pack2(ev.y * a.sm_scale, od.y * a.sm_scale);
  out.z = pack2(ev.z * a.sm_scale, od.z * a.sm_scale);
  out.w = pack2(ev.w * a.sm_scale, od.w * a.sm_scale);
  kb_elem* dst = g.dq + b * g.dq_stride[0] + h * g.dq_stride[1] + row * g.dq_stride[2] + col;
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    *reinterpret_cast<uint4*>(dst) = out;
  } else {  // dq's rows need only 4-byte alignment (the launcher's rule for gradients)
    uint32_t* d32 = reinterpret_cast<uint32_t*>(dst);
    d32[0] = out.x; d32[1] = out.y; d32[2] = out.z; d32[3] = out.w;
  }
}

}  // namespace kb90b

__global__ void __launch_bounds__(256, 1)
kb_sm90_bwd(const KbArgs a, const KbBwdArgs g, const __grid_constant__ CUtensorMap map_q,
            const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v,
            const __grid_constant__ CUtensorMap map_do) {
  using namespace kb90b;
  extern __shared__ __align__(1024) uint8_t kb_smem_raw[];
  BSmem sm;
  sm.base = (smem_u32(kb_smem_raw) + 1023u) & ~1023u;
  const int tid = threadIdx.x;
  const BTile t = make_btile(a);
  if (tid == 0) {
    mbar_init(sm.bar_kv(), 1);
    for (int s = 0; s < BSTAGES; ++s) {
      mbar_init(sm.full(s), 1);
      mbar_init(sm.empty(s), 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    tma_prefetch_map(&map_q);
    tma_prefetch_map(&map_do);
    mbar_expect_tx(sm.bar_kv(), 2 * KT_BYTES);
#pragma unroll
    for (int p = 0; p < NPANEL; ++p) {
      tma_load_4d(sm.k() + p * KT_PANEL, &map_k, sm.bar_kv(), p * 64, t.n_start, t.hk, t.b);
      tma_load_4d(sm.v() + p * KT_PANEL, &map_v, sm.bar_kv(), p * 64, t.n_start, t.hk, t.b);
    }
  }
  fill_kinds(a, t, sm, tid);
  __syncthreads();
  Walk cur{-1, 0};
  bool more = cur.next(a, t, sm);
  // Two warpgroups of 64 key rows each; no producer warpgroup, so that each thread may hold the ~250
  // registers of dK, dV, S and dP at D = 128 (three warpgroups cap them at 240 even with setmaxnreg).
  BwdConsumer c(a, g, t, sm, &map_q, &map_do, LoadCursor{cur, more, 0}, tid / 128, tid % 128);
  c.poll(0, true);
  mbar_wait(sm.bar_kv(), 0);  // always: the CTA must not exit under an in-flight TMA write
  for (int it = 0; more; ++it) {
    c.step(it, cur.h(t), cur.m0(t), cur.kind);
    more = cur.next(a, t, sm);
  }
  c.finish();
}

extern "C" int kb_sm90_bwd_launch(const KbArgs* args, KbBwdArgs* gargs, void* stream) {
  const KbArgs& a = *args;
  KbBwdArgs& g = *gargs;
  if (a.D != KB_HEAD_DIM) return 10001;
  if (a.Hkv <= 0 || a.Hq <= 0 || a.Hq % a.Hkv != 0 || a.B < 0 || a.M < 0 || a.N < 0) return 10003;
  if (a.M >= (1ll << 31) || a.N >= (1ll << 31) || a.Hq >= 65536 || a.B >= 65536) return 10005;
  g.M_pad = (a.M + kb90b::PAD_Q - 1) / kb90b::PAD_Q * kb90b::PAD_Q;  // the host pads its scratch to the same
  if (a.B == 0 || (a.M == 0 && a.N == 0)) return 0;
  if (!kb_tma_ok(a.q, a.q_stride) || !kb_tma_ok(a.k, a.k_stride) || !kb_tma_ok(a.v, a.v_stride) ||
      !kb_tma_ok(g.dout, g.do_stride))
    return 10002;
  const long long o_elem = g.o_f32 ? 4 : 2;  // kb_sm90_bwd_pre reads O 16 bytes at a time
  if ((reinterpret_cast<uintptr_t>(g.o) & 15) != 0 || g.o_stride[3] != 1 || (g.o_stride[0] * o_elem) % 16 ||
      (g.o_stride[1] * o_elem) % 16 || (g.o_stride[2] * o_elem) % 16)
    return 10002;
  kb_elem* outs[3] = {g.dq, g.dk, g.dv};
  const long long* ostr[3] = {g.dq_stride, g.dk_stride, g.dv_stride};
  for (int i = 0; i < 3; ++i)
    if ((reinterpret_cast<uintptr_t>(outs[i]) & 3) != 0 || ostr[i][3] != 1 || ostr[i][0] % 2 || ostr[i][1] % 2 ||
        ostr[i][2] % 2)
      return 10002;  // gradients are stored as 16-bit pairs
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemsetAsync(g.dq_acc, 0, sizeof(float) * a.B * a.Hq * g.M_pad * KB_HEAD_DIM, st);
  if (e != cudaSuccess) return e;
  constexpr int PRE_ROWS = 256 / (KB_HEAD_DIM / 8);  // rows per block of kb_sm90_bwd_pre
  if (a.Hq > 0 && g.M_pad > 0)
    kb90b::kb_sm90_bwd_pre<<<dim3(static_cast<unsigned>((g.M_pad + PRE_ROWS - 1) / PRE_ROWS), static_cast<unsigned>(a.Hq),
                                  static_cast<unsigned>(a.B)), 256, 0, st>>>(a, g);
  if (a.N > 0 && a.M > 0) {
    CUtensorMap mq, mk, mv, mdo;
    if (!kb_make_map(&mq, a.q, a.q_stride, a.B, a.Hq, a.M, a.D, kb90b::BQ) ||
        !kb_make_map(&mk, a.k, a.k_stride, a.B, a.Hkv, a.N, a.D, kb90b::BK) ||
        !kb_make_map(&mv, a.v, a.v_stride, a.B, a.Hkv, a.N, a.D, kb90b::BK) ||
        !kb_make_map(&mdo, g.dout, g.do_stride, a.B, a.Hq, a.M, a.D, kb90b::BQ))
      return 10004;
    static bool attr_set = false;
    if (!attr_set) {
      e = cudaFuncSetAttribute(kb_sm90_bwd, cudaFuncAttributeMaxDynamicSharedMemorySize, kb90b::SMEM_BYTES);
      if (e != cudaSuccess) return e;
      attr_set = true;
    }
    dim3 grid(static_cast<unsigned>((a.N + kb90b::BK - 1) / kb90b::BK), static_cast<unsigned>(a.Hkv),
              static_cast<unsigned>(a.B));
    kb_sm90_bwd<<<grid, 256, kb90b::SMEM_BYTES, st>>>(a, g, mq, mk, mv, mdo);
  } else if (a.N > 0) {
    // no query rows: dk = dv = 0
    for (int i = 1; i < 3; ++i)
      for (long long b = 0; b < a.B; ++b)
        for (long long h = 0; h < a.Hkv; ++h) {
          e = cudaMemset2DAsync(outs[i] + b * ostr[i][0] + h * ostr[i][1], ostr[i][2] * sizeof(kb_elem), 0,
                                a.D * sizeof(kb_elem), a.N, st);
          if (e != cudaSuccess) return e;
        }
  }
  const long long post_threads = a.B * a.Hq * (g.M_pad / 64) * (KB_HEAD_DIM / 64) * 512;
  if (a.M > 0 && post_threads > 0)
    kb90b::kb_sm90_bwd_post<<<(unsigned)((post_threads + 255) / 256), 256, 0, st>>>(a, g);
  return static_cast<int>(cudaGetLastError());
}
"""


def sm90_backward_source(*, head_dim_pad: int, dtype: str = "bf16") -> str:
    """The backward's CUDA C++, to follow kb.lower.cuda_sm90's forward source in one translation unit."""
    if head_dim_pad not in (64, 128):
        raise ValueError(f"head_dim_pad {head_dim_pad} is not supported (64 or 128)")
    ab = _ELEM[dtype][1]
    bq, dq_n = bwd_block_q(head_dim_pad), _dq_n(head_dim_pad)
    wrappers = _wgmma_ss(bq, ab) + _wgmma_rs(head_dim_pad, ab) + _wgmma_ss_tt(dq_n, ab)  # each guarded
    subs = {"@BQ@": str(bq), "@PADQ@": str(BWD_PAD_Q), "@BK@": str(BWD_BLOCK_KV), "@HD@": str(head_dim_pad),
            "@SMEM@": str(bwd_smem_bytes(head_dim_pad)), "@KIND_CAP@": str(KIND_CAP), "@DQN@": str(dq_n)}
    text = "namespace kb90 {\n" + wrappers + "}  // namespace kb90\n" + _BWD
    for key, val in subs.items():
        text = text.replace(key, val)
    return text
