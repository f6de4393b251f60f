"""Hopper (sm_90a) attention forward: a warp-specialized CUDA C++ template with variant hooks.

`sm90_forward_source(hooks, head_dim_pad=, block_m=, block_n=)` returns one plain CUDA C++
translation unit (no CUTLASS/CuTe; inline PTX for wgmma, TMA, mbarrier, setmaxnreg) computing
  o[b,h,i,:] = softmax_j(score(i,j)) @ v[b,hk,j,:],  lse[b,h,i] = logsumexp_j score(i,j)  (fp32, ln)
with hk = h / (Hq/Hkv); a row with every score -inf gives o = 0 and lse = -inf.

The variant comes in through `hooks`, C++ placed before the kernel, which defines `struct KbArgs`
and four device functions (see `HOOK_INTERFACE`); `KB_BLOCK_M`, `KB_BLOCK_N` and `KB_HEAD_DIM`
are defined before it so that hooks may use them. The kernel itself masks kv_idx outside [0, N)
and never stores rows q_idx >= M; hooks are not called for such rows or columns.

Kernel shape (one CTA per (query tile of 128 rows, head, batch), heaviest causal tiles first):
- warpgroup 0 is the producer: registers lowered with setmaxnreg, one thread issues TMA loads
  (128B swizzle) of the Q tile once and of K/V tiles into a 2-stage ring, full/empty mbarriers
  per stage and per tensor (K and V are released separately);
- warpgroups 1 and 2 are consumers, 64 query rows each, registers raised: S = Q K^T with
  `wgmma m64nBNk16` (A and B from shared memory, K-major), online softmax on the accumulator
  registers (row statistics reduced over the 4 threads of a quad), P packed to 16-bit in
  registers as the A operand of O += P V (`wgmma` with B = V read MN-major, "transposed");
- `overlap=True`: iteration j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back and
  runs the softmax of S_j while the second GEMM is in flight (FA3's intra-warpgroup overlap);
- `pingpong=True`: the two consumer warpgroups take turns issuing GEMMs through two named
  barriers, so that one warpgroup's softmax runs under the other's tensor-core work;
- epilogue: o / l converted to 16-bit and stored directly from registers; lse in fp32.

Host side: `extern "C" int kb_sm90_launch(const KbArgs*, void* stream)` checks D and the TMA
stride rules, encodes the tensor maps through `cudaGetDriverEntryPointByVersion` (no -lcuda),
sets the dynamic shared-memory limit and launches; it returns 0, a cudaError_t or one of
`ERROR_CODES`, named by `kb_sm90_error_string`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "HOOK_INTERFACE", "ERROR_CODES", "SM90_ARCH", "Sm90Config", "sm90_forward_source", "kbargs_struct",
    "causal_hooks", "plain_hooks",
]

SM90_ARCH = "sm_90a"  # kb.lower.cuda_build turns this into -gencode=arch=compute_90a,code=sm_90a

HOOK_INTERFACE = """\
// KV range of the query tile [m_start, m_start+KB_BLOCK_M): blocks n_start = lo, lo+KB_BLOCK_N, ... < hi
__device__ void kb_kv_range(const KbArgs& a, long long b, long long h, long long m_start, long long& lo, long long& hi);
// 0 = skip the (query tile, key tile) entirely, 1 = partial (kb_score per element), 2 = full (s * sm_scale)
__device__ int kb_block_kind(const KbArgs& a, long long b, long long h, long long m_start, long long n_start);
// what the score statements need of one query row, computed once per CTA and thread row (struct KbRow)
__device__ KbRow kb_row(const KbArgs& a, long long b, long long h, long long q_idx);
// raw score s = q.k of (row, kv_idx) -> final score (natural-log domain, sm_scale included), -INFINITY masks
__device__ float kb_score(const KbArgs& a, const KbRow& row, long long kv_idx, float s);
"""

# Codes above every cudaError_t value; kb_sm90_error_string names them.
ERROR_CODES = {
    10001: "head dim D differs from the kernel's head_dim_pad; build the kernel for this D",
    10002: "q/k/v/o need a last stride of 1, other strides and base pointers 16-byte aligned (TMA rules)",
    10003: "Hq must be a positive multiple of Hkv, and B, M, N >= 0",
    10004: "cuTensorMapEncodeTiled is unavailable from the driver or rejected a tensor map",
    10005: "dimensions too large for the kernel (M or N >= 2^31, Hq or B >= 65536)",
}

_ELEM = {"bf16": ("__nv_bfloat16", "bf16", "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", "__floats2bfloat162_rn",
                  "__nv_bfloat162"),
         "fp16": ("__half", "f16", "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "__floats2half2_rn", "__half2")}


@dataclass(frozen=True)
class Sm90Config:
    """Tile shape and schedule of one generated kernel; `validate` states what is supported."""

    head_dim_pad: int
    block_m: int = 128
    block_n: int = 128
    dtype: str = "bf16"
    overlap: bool = True  # issue S_j and P_{j-1} V_{j-1} together, softmax under the second GEMM
    pingpong: bool = True  # consumer warpgroups take turns on the tensor cores (named barriers)
    stages: int = 2

    @property
    def smem_bytes(self) -> int:
        q = self.block_m * self.head_dim_pad * 2
        kv = self.block_n * self.head_dim_pad * 2
        return q + 2 * self.stages * kv + 128 + 1024  # + barriers + slack for 1024-byte alignment

    def validate(self) -> None:
        if self.head_dim_pad not in (64, 128):
            raise ValueError(f"head_dim_pad {self.head_dim_pad} is not supported (64 or 128)")
        if self.block_m != 128:
            raise ValueError("block_m must be 128 (two consumer warpgroups of 64 rows)")
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise ValueError(f"block_n {self.block_n} must be a multiple of 16 in [16, 256]")
        if self.dtype not in _ELEM:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_ELEM)}")
        if self.stages < 2:
            raise ValueError("stages must be >= 2")
        if self.smem_bytes > 227 * 1024:
            raise ValueError(f"{self.smem_bytes} bytes of shared memory exceed the 227 KB limit")


def kbargs_struct(elem: str = "__nv_bfloat16", extra_fields: str = "") -> str:
    """The `KbArgs` struct of the hook interface, with optional aux fields appended."""
    return (
        "struct KbArgs {\n"
        f"  const {elem} *q, *k, *v; {elem}* o; float* lse;\n"
        "  long long q_stride[4], k_stride[4], v_stride[4], o_stride[4], lse_stride[3];\n"
        "  long long B, Hq, Hkv, M, N, D; float sm_scale;\n"
        f"{extra_fields}"
        "};\n"
    )


def plain_hooks(dtype: str = "bf16") -> str:
    """No mask: every key block is full."""
    return kbargs_struct(_ELEM[dtype][0]) + """\
__device__ __forceinline__ void kb_kv_range(const KbArgs& a, long long b, long long h, long long m_start,
                                            long long& lo, long long& hi) { lo = 0; hi = a.N; }
__device__ __forceinline__ int kb_block_kind(const KbArgs& a, long long b, long long h, long long m_start,
                                             long long n_start) { return 2; }
struct KbRow { float scale; };
__device__ __forceinline__ KbRow kb_row(const KbArgs& a, long long b, long long h, long long q_idx) {
  return {a.sm_scale};
}
__device__ __forceinline__ float kb_score(const KbArgs& a, const KbRow& r, long long kv_idx, float s) {
  return s * r.scale;
}
"""


def causal_hooks(dtype: str = "bf16") -> str:
    """Top-left causal mask: kv_idx > q_idx is masked."""
    return kbargs_struct(_ELEM[dtype][0]) + """\
__device__ __forceinline__ void kb_kv_range(const KbArgs& a, long long b, long long h, long long m_start,
                                            long long& lo, long long& hi) {
  lo = 0; hi = m_start + KB_BLOCK_M; if (hi > a.N) hi = a.N;
}
__device__ __forceinline__ int kb_block_kind(const KbArgs& a, long long b, long long h, long long m_start,
                                             long long n_start) {
  if (n_start > m_start + KB_BLOCK_M - 1) return 0;   // every key after every query
  if (n_start + KB_BLOCK_N - 1 <= m_start) return 2;  // every key at or before every query
  return 1;
}
struct KbRow { long long q_idx; float scale; };
__device__ __forceinline__ KbRow kb_row(const KbArgs& a, long long b, long long h, long long q_idx) {
  return {q_idx, a.sm_scale};
}
__device__ __forceinline__ float kb_score(const KbArgs& a, const KbRow& r, long long kv_idx, float s) {
  return kv_idx > r.q_idx ? -INFINITY : s * r.scale;
}
"""


# ---------------------------------------------------------------------------------------------
# wgmma wrappers, generated because the operand lists are long and fixed by the tile shape.

def _wgmma_ss(n: int, ab: str) -> str:
    """D[64 x n] (+)= A[64 x 16] B[16 x n], A and B K-major in shared memory (descriptors)."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return f"""\
#ifndef KB_WGMMA_SS_N{n}
#define KB_WGMMA_SS_N{n}
// S-type GEMM: both operands K-major (row-major tiles with the 16-element k slice contiguous),
// 128B-swizzled; imm-scale-a/b = 1, tnsp-a = tnsp-b = 0; scale_d = 0 overwrites d.
__device__ __forceinline__ void kb_wgmma_ss_n{n}(float (&d)[{regs}], uint64_t desc_a, uint64_t desc_b, int scale_d) {{
  asm volatile(
    "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"
    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} "
    "{{{outs}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}\\n"
    : {cons}
    : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}}
#endif
"""


def _wgmma_rs(n: int, ab: str) -> str:
    """D[64 x n] += A[64 x 16] (registers) B[16 x n] (shared memory, MN-major: tnsp-b = 1)."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    a = ", ".join(f"%{regs + i}" for i in range(4))
    return f"""\
#ifndef KB_WGMMA_RS_N{n}
#define KB_WGMMA_RS_N{n}
// PV-type GEMM: A = four 32-bit registers per thread holding 16-bit pairs in the m64k16 A-fragment
// layout; B = V tile whose N (head-dim) axis is contiguous, hence tnsp-b = 1.
__device__ __forceinline__ void kb_wgmma_rs_n{n}(float (&d)[{regs}], const uint32_t* a, uint64_t desc_b) {{
  asm volatile(
    "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"
    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} "
    "{{{outs}}}, {{{a}}}, %{regs + 4}, p, 1, 1, 1;\\n}}\\n"
    : {cons}
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}}
#endif
"""


_PRELUDE = r"""
// ---- generated by kb.lower.cuda_sm90: Hopper (sm_90a) attention forward ----
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>

#define KB_BLOCK_M @BM@
#define KB_BLOCK_N @BN@
#define KB_HEAD_DIM @HD@

// ---- variant hooks (supplied by the caller) ----
@HOOKS@
// ---- end of hooks ----
"""

_DEVICE = r"""
typedef @ELEM@ kb_elem;
typedef @ELEM2@ kb_elem2;

namespace kb90 {

constexpr int BM = KB_BLOCK_M;           // query rows per CTA: 2 consumer warpgroups x 64
constexpr int BN = KB_BLOCK_N;           // key rows per pipeline stage
constexpr int HD = KB_HEAD_DIM;          // head dim (padded == actual)
constexpr int STAGES = @STAGES@;
constexpr int NPANEL = HD / 64;          // 64-element (128-byte) column panels: the TMA box width
constexpr int Q_PANEL = BM * 128;        // bytes of one Q panel: BM rows x 128 B
constexpr int KV_PANEL = BN * 128;       // bytes of one K or V panel
constexpr int Q_BYTES = NPANEL * Q_PANEL;
constexpr int KV_BYTES = NPANEL * KV_PANEL;
constexpr int BAR_OFF = Q_BYTES + 2 * STAGES * KV_BYTES;
constexpr int SMEM_BYTES = BAR_OFF + 128 + 1024;  // barriers + slack to align the base to 1024
constexpr int NTHREADS = 384;            // producer warpgroup + 2 consumer warpgroups
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr bool OVERLAP = @OVERLAP@;
constexpr bool PINGPONG = @PINGPONG@;
static_assert(HD % 64 == 0 && BN % 16 == 0 && BM == 128, "tile shape");
// 128B swizzle: TMA and wgmma both XOR address bits [4:6] with bits [7:9], so every panel must
// start 1024-byte aligned (8 rows x 128 B); BM*128 and BN*128 are multiples of 1024 for BN % 8 == 0.
static_assert(Q_PANEL % 1024 == 0 && KV_PANEL % 1024 == 0, "panels must keep 1024-byte alignment");

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ----
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed. A fresh barrier is in phase 0, so a
// wait on parity 1 passes at once (the producer's first pass over the empty barriers).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}

// ---- TMA: 4-D tiled load (coordinates innermost first: d, row, head, batch) ----
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
    "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
    :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
    : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- named barriers for the consumer ping-pong (id 0 is __syncthreads) ----
__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(n) : "memory");
}

// ---- wgmma plumbing ----
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// The compiler does not know wgmma is asynchronous: these empty asm statements pin a register's
// value at a point (after wait_group), so that no read, write or reuse of it moves across.
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
__device__ __forceinline__ void reg_fence(uint32_t& r) { asm volatile("" : "+r"(r) :: "memory"); }
template <int N> __device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) reg_fence(r[i]);
}
template <int N> __device__ __forceinline__ void reg_fence(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) reg_fence(r[i]);
}

// Shared-memory matrix descriptor (PTX "matrix descriptor"): bits 0-13 start address >> 4,
// 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4, 49-51 base offset (0: every
// swizzle atom is 1024-byte aligned here), 62-63 layout type (1 = 128B swizzle).
__device__ __forceinline__ uint64_t make_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
// K-major operand (Q as A, K as B) of k-step kk (16 elements of the head dim): the tile is
// NPANEL panels of [rows x 64 elements], rows 128 B apart; 8-row groups are 1024 B apart (SBO);
// LBO is unused for swizzled K-major layouts (set to 1 by convention -> 16 bytes). Within a
// 128-byte swizzle row the k-step advances the start address by 32 B (16 x 2 B): the hardware
// applies the XOR swizzle to the final address, which matches what TMA wrote because the panel
// base is 1024-aligned and 32*kk + 16*c never carries past bit 6.
__device__ __forceinline__ uint64_t desc_kmajor(uint32_t tile, int panel_bytes, int kk) {
  return make_desc(tile + (kk / 4) * panel_bytes + (kk % 4) * 32, 16, 1024);
}
// MN-major operand (V as B of O += P V): the GEMM's K axis is the key row, its N axis the head
// dim, contiguous in each 128-byte row. Canonical MN-major 128B layout, in 16-byte units:
// ((8, n), (8, k)) : ((1, LBO), (8, SBO)) -> 64 head-dim elements per swizzled row, the next 64
// (next panel) LBO = KV_PANEL bytes away; 8 key rows 128 B apart, the next 8 rows SBO = 1024 B
// away. k-step kk (key rows 16kk..16kk+15) starts 16 rows = 2048 B further (1024-aligned).
__device__ __forceinline__ uint64_t desc_v(uint32_t tile, int kk) {
  return make_desc(tile + kk * 2048, KV_PANEL, 1024);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));  // ex2(-inf) = +0
  return y;
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  kb_elem2 v = @PACK@(lo, hi);  // .x (low half) = lo: the lower column of the pair
  return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace kb90
"""

_KERNEL = r"""
namespace kb90 {

// Shared-memory map (offsets from the 1024-aligned base): Q panels | K stages | V stages | barriers.
struct Smem {
  uint32_t base;
  __device__ uint32_t q() const { return base; }
  __device__ uint32_t k(int s) const { return base + Q_BYTES + s * KV_BYTES; }
  __device__ uint32_t v(int s) const { return base + Q_BYTES + (STAGES + s) * KV_BYTES; }
  __device__ uint32_t bar_q() const { return base + BAR_OFF; }
  __device__ uint32_t k_full(int s) const { return base + BAR_OFF + 8 * (1 + s); }
  __device__ uint32_t v_full(int s) const { return base + BAR_OFF + 8 * (1 + STAGES + s); }
  __device__ uint32_t k_empty(int s) const { return base + BAR_OFF + 8 * (1 + 2 * STAGES + s); }
  __device__ uint32_t v_empty(int s) const { return base + BAR_OFF + 8 * (1 + 3 * STAGES + s); }
};
constexpr uint32_t CONSUMER_THREADS = 256;  // arrivals that free one K or V stage

struct Tile {  // the CTA's query tile and its key-block walk (identical in every role)
  long long b, h, hk, m_start, lo, hi, nblk;
  __device__ long long n_start(long long i) const { return lo + i * BN; }
};

__device__ __forceinline__ Tile make_tile(const KbArgs& a, int num_m_blocks) {
  Tile t;
  t.b = blockIdx.z;
  t.h = blockIdx.y;
  t.hk = t.h / (a.Hq / a.Hkv);
  t.m_start = static_cast<long long>(num_m_blocks - 1 - static_cast<int>(blockIdx.x)) * BM;  // heavy tiles first
  kb_kv_range(a, t.b, t.h, t.m_start, t.lo, t.hi);
  if (t.lo < 0) t.lo = 0;
  if (t.hi > a.N) t.hi = a.N;
  t.nblk = t.hi > t.lo ? (t.hi - t.lo + BN - 1) / BN : 0;
  return t;
}

// ---------------- producer: one thread issues every TMA load ----------------
__device__ __forceinline__ void producer(const KbArgs& a, const Tile& t, const Smem& sm, const CUtensorMap* mq,
                                         const CUtensorMap* mk, const CUtensorMap* mv) {
  tma_prefetch_map(mq);
  tma_prefetch_map(mk);
  tma_prefetch_map(mv);
  // TMA counts the whole box in complete_tx, zero-filled out-of-bounds rows included.
  mbar_expect_tx(sm.bar_q(), Q_BYTES);
#pragma unroll
  for (int p = 0; p < NPANEL; ++p)
    tma_load_4d(sm.q() + p * Q_PANEL, mq, sm.bar_q(), p * 64, (int)t.m_start, (int)t.h, (int)t.b);
  int it = 0;
  for (long long i = t.nblk - 1; i >= 0; --i) {  // last key block first: the masked ones lead
    const long long n0 = t.n_start(i);
    if (kb_block_kind(a, t.b, t.h, t.m_start, n0) == 0) continue;
    const int s = it % STAGES;
    const uint32_t ph = (it / STAGES) & 1;
    mbar_wait(sm.k_empty(s), ph ^ 1);
    mbar_expect_tx(sm.k_full(s), KV_BYTES);
#pragma unroll
    for (int p = 0; p < NPANEL; ++p)
      tma_load_4d(sm.k(s) + p * KV_PANEL, mk, sm.k_full(s), p * 64, (int)n0, (int)t.hk, (int)t.b);
    mbar_wait(sm.v_empty(s), ph ^ 1);
    mbar_expect_tx(sm.v_full(s), KV_BYTES);
#pragma unroll
    for (int p = 0; p < NPANEL; ++p)
      tma_load_4d(sm.v(s) + p * KV_PANEL, mv, sm.v_full(s), p * 64, (int)n0, (int)t.hk, (int)t.b);
    ++it;
  }
}

// ---------------- consumer warpgroup: 64 query rows ----------------
// Accumulator layout of wgmma m64nNk16 (fp32), thread t of the warpgroup, warp w = t/32, lane l:
//   d[4i + 2r + e] is row 16w + l/4 + 8r, column 8i + 2(l%4) + e   (i < N/8, r, e in {0, 1}).
// So each thread holds two rows (r = 0, 1), and a row is spread over the 4 lanes of a quad.
// A-fragment of m64k16 from registers (16-bit): a[j] packs row 16w + l/4 + 8(j%2), columns
//   8(j/2) + 2(l%4) + {0, 1}. For k-step kk of P V this is exactly pack(d[8kk+2j], d[8kk+2j+1]),
// so P as the A operand is p[i] = pack(S[2i], S[2i+1]) with no data movement.
struct Consumer {
  const KbArgs& a;
  const Tile& t;
  const Smem& sm;
  int cw;        // consumer warpgroup 0 or 1: rows 64cw .. 64cw+63 of the tile
  int lane, warp;
  long long q0;  // query index of this thread's row r = 0 (row r = 1 is q0 + 8)
  KbRow rows[2];  // kb_row of this thread's two query rows (rows >= M: never read)
  float o[HD / 2];
  float sacc[BN / 2];
  uint32_t p[BN / 4];
  float m_run[2], l_run[2];
  int turn_left;  // GEMM turns still to take (ping-pong)

  __device__ Consumer(const KbArgs& a_, const Tile& t_, const Smem& sm_, int cw_, int tid)
      : a(a_), t(t_), sm(sm_), cw(cw_) {
    lane = tid % 32;
    warp = tid / 32;
    q0 = t.m_start + 64 * cw + 16 * warp + lane / 4;
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (q0 + 8 * r < a.M) rows[r] = kb_row(a, t.b, t.h, q0 + 8 * r);  // once per CTA: the rows never change
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
  }

  // Ping-pong: warpgroup cw waits on barrier 1 + cw, then hands the turn to the other one.
  // Every turn of one warpgroup is matched by one turn of the other (same block walk), and the
  // second warpgroup's last hand-back is skipped so that no arrival is left pending at exit.
  __device__ __forceinline__ void turn_begin() {
    if (PINGPONG) named_sync(1 + cw, 2 * 128);
  }
  __device__ __forceinline__ void turn_end() {
    if (PINGPONG) {
      --turn_left;
      if (cw == 0 || turn_left > 0) named_arrive(2 - cw, 2 * 128);
    }
  }

  __device__ __forceinline__ void gemm_qk(int s) {
    const uint32_t qa = sm.q() + cw * 64 * 128;  // this warpgroup's 64 rows: 8 swizzle atoms in
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      kb_wgmma_ss_n@BN@(sacc, desc_kmajor(qa, Q_PANEL, kk), desc_kmajor(sm.k(s), KV_PANEL, kk), kk > 0 ? 1 : 0);
  }
  __device__ __forceinline__ void gemm_pv(int s) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) kb_wgmma_rs_n@HD@(o, &p[4 * kk], desc_v(sm.v(s), kk));
  }

  // Scores of one block in the log2 domain (score * log2 e), masked to -inf, into sacc.
  __device__ __forceinline__ void scores(int kind, long long n0) {
    const float scale2 = a.sm_scale * LOG2E;
    const long long N = a.N, M = a.M;
    if (kind == 2 && n0 + BN <= N) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) sacc[i] *= scale2;
      return;
    }
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const long long kv = n0 + 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
      const long long q = q0 + 8 * ((i / 2) % 2);
      float x;
      if (kv < 0 || kv >= N) x = -INFINITY;
      else if (kind == 2) x = sacc[i] * scale2;
      else if (q >= M) x = -INFINITY;  // a ragged-tail row: never stored, keep hooks in bounds
      else x = kb_score(a, rows[(i / 2) % 2], kv, sacc[i]) * LOG2E;
      sacc[i] = x;
    }
  }

  // Online softmax on sacc: new row max (quad-reduced), sacc <- exp2(x - max), running sum
  // (thread-partial: the quad reduction of l waits for the epilogue). Returns the O rescale.
  __device__ __forceinline__ void softmax(float (&alpha)[2]) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) mx[(i / 2) % 2] = fmaxf(mx[(i / 2) % 2], sacc[i]);
    float msafe[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float mnew = fmaxf(m_run[r], mx[r]);
      msafe[r] = mnew == -INFINITY ? 0.f : mnew;  // all masked so far: exponents give 0, not NaN
      alpha[r] = fast_exp2(m_run[r] - msafe[r]);  // m_run = -inf -> 0 (o and l are still 0)
      m_run[r] = mnew;
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int r = (i / 2) % 2;
      sacc[i] = fast_exp2(sacc[i] - msafe[r]);
      sum[r] += sacc[i];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + sum[r];
  }

  __device__ __forceinline__ void rescale_o(const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] *= alpha[(i / 2) % 2];
  }
  __device__ __forceinline__ void pack_p() {
#pragma unroll
    for (int i = 0; i < BN / 4; ++i) p[i] = pack2(sacc[2 * i], sacc[2 * i + 1]);
  }

  // S_j = Q K_j^T, then its scores and softmax; the K stage is released after the GEMM.
  __device__ __forceinline__ void qk_softmax_serial(int s, uint32_t ph, int kind, long long n0, float (&alpha)[2]) {
    mbar_wait(sm.k_full(s), ph);
    turn_begin();
    wg_fence();
    gemm_qk(s);
    wg_commit();
    turn_end();
    wg_wait<0>();
    reg_fence(sacc);
    mbar_arrive(sm.k_empty(s));
    scores(kind, n0);
    softmax(alpha);
  }

  __device__ __forceinline__ void pv_serial(int s, uint32_t ph) {
    mbar_wait(sm.v_full(s), ph);
    turn_begin();
    wg_fence();  // o and p were written by ordinary instructions
    gemm_pv(s);
    wg_commit();
    turn_end();
    wg_wait<0>();
    reg_fence(o);
    reg_fence(p);
    mbar_arrive(sm.v_empty(s));
  }

  __device__ __forceinline__ void run() {
    int n_valid = 0;
    for (long long i = t.nblk - 1; i >= 0; --i)
      if (kb_block_kind(a, t.b, t.h, t.m_start, t.n_start(i)) != 0) ++n_valid;
    turn_left = n_valid == 0 ? 0 : (OVERLAP ? n_valid + 1 : 2 * n_valid);
    if (PINGPONG && cw == 1 && turn_left > 0) named_arrive(1, 2 * 128);  // warpgroup 0 goes first
    // Always wait for Q, even with no key block: the CTA must not exit under an in-flight TMA write.
    mbar_wait(sm.bar_q(), 0);

    int it = 0;
    int s_prev = 0;
    for (long long i = t.nblk - 1; i >= 0; --i) {
      const long long n0 = t.n_start(i);
      const int kind = kb_block_kind(a, t.b, t.h, t.m_start, n0);
      if (kind == 0) continue;
      const int s = it % STAGES;
      const uint32_t ph = (it / STAGES) & 1;
      float alpha[2];
      if (!OVERLAP) {
        qk_softmax_serial(s, ph, kind, n0, alpha);
        rescale_o(alpha);
        pack_p();
        pv_serial(s, ph);
      } else if (it == 0) {
        qk_softmax_serial(s, ph, kind, n0, alpha);
        pack_p();  // o is still 0: no rescale needed
      } else {
        // One turn issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}; the softmax of S_j then runs
        // while the second GEMM is in flight (groups retire in order: wait<1> -> S_j done).
        const uint32_t ph_prev = ((it - 1) / STAGES) & 1;
        mbar_wait(sm.k_full(s), ph);
        mbar_wait(sm.v_full(s_prev), ph_prev);
        turn_begin();
        wg_fence();
        gemm_qk(s);
        wg_commit();
        gemm_pv(s_prev);
        wg_commit();
        turn_end();
        wg_wait<1>();
        reg_fence(sacc);
        mbar_arrive(sm.k_empty(s));
        scores(kind, n0);
        softmax(alpha);
        wg_wait<0>();
        reg_fence(o);
        reg_fence(p);  // P_{j-1} stays live until its GEMM has retired
        mbar_arrive(sm.v_empty(s_prev));
        rescale_o(alpha);
        pack_p();
      }
      s_prev = s;
      ++it;
    }
    if (OVERLAP && it > 0) {
      const uint32_t ph_prev = ((it - 1) / STAGES) & 1;
      pv_serial(s_prev, ph_prev);  // the last block's P V
    }
    epilogue();
  }

  __device__ __forceinline__ void epilogue() {
    float inv[2], lse[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv[r] = l > 0.f ? 1.f / l : 0.f;
      lse[r] = l > 0.f ? (m_run[r] + __log2f(l)) * LN2 : -INFINITY;
    }
    kb_elem* ob = (kb_elem*)a.o + t.b * a.o_stride[0] + t.h * a.o_stride[1];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const long long q = q0 + 8 * r;
      if (q >= a.M) continue;
      kb_elem* orow = ob + q * a.o_stride[2];
#pragma unroll
      for (int c = 0; c < HD / 8; ++c) {
        const int col = 8 * c + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(orow + col) = pack2(o[4 * c + 2 * r] * inv[r], o[4 * c + 2 * r + 1] * inv[r]);
      }
      if (lane % 4 == 0) a.lse[t.b * a.lse_stride[0] + t.h * a.lse_stride[1] + q * a.lse_stride[2]] = lse[r];
    }
  }
};

}  // namespace kb90

__global__ void __launch_bounds__(kb90::NTHREADS, 1)
kb_sm90_fwd(const KbArgs a, const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
            const __grid_constant__ CUtensorMap map_v, int num_m_blocks) {
  using namespace kb90;
  extern __shared__ __align__(1024) uint8_t kb_smem_raw[];
  Smem sm;
  sm.base = (smem_u32(kb_smem_raw) + 1023u) & ~1023u;  // 128B swizzle atoms need 1024-byte alignment
  const int tid = threadIdx.x;
  if (tid == 0) {
    mbar_init(sm.bar_q(), 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(sm.k_full(s), 1);  // the producer's arrive.expect_tx; TMA completes the bytes
      mbar_init(sm.v_full(s), 1);
      mbar_init(sm.k_empty(s), CONSUMER_THREADS);
      mbar_init(sm.v_empty(s), CONSUMER_THREADS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // barrier words visible to TMA
  }
  __syncthreads();
  const Tile t = make_tile(a, num_m_blocks);
  if (tid < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 @PRODUCER_REGS@;\n" ::: "memory");
    if (tid == 0) producer(a, t, sm, &map_q, &map_k, &map_v);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 @CONSUMER_REGS@;\n" ::: "memory");
    Consumer c(a, t, sm, tid / 128 - 1, tid % 128);
    c.run();
  }
}
"""

_HOST = r"""
// ---------------- host side ----------------
typedef CUresult (*kb_encode_tiled_fn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                       const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                       CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static kb_encode_tiled_fn kb_encode_fn() {
  static kb_encode_tiled_fn fn = nullptr;
  if (!fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<kb_encode_tiled_fn>(p);
  }
  return fn;
}

// A [B, H, L, D] tensor as a 4-D tensor map (innermost first: d, row, head, batch); box
// 64 x rows x 1 x 1 with the 128-byte swizzle that the wgmma descriptors assume. Rows past L
// (and negative rows) are zero-filled by TMA, so a ragged tail never reads another head.
static bool kb_make_map(CUtensorMap* map, const void* ptr, const long long* stride, long long Bn, long long H,
                        long long L, long long D, int box_rows) {
  kb_encode_tiled_fn fn = kb_encode_fn();
  if (!fn) return false;
  cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)(L > 0 ? L : 1), (cuuint64_t)H, (cuuint64_t)Bn};
  cuuint64_t strides[3] = {(cuuint64_t)stride[2] * 2, (cuuint64_t)stride[1] * 2, (cuuint64_t)stride[0] * 2};
  cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1};
  cuuint32_t estr[4] = {1, 1, 1, 1};
  CUresult r = fn(map, @TMA_DTYPE@, 4, const_cast<void*>(ptr), dims, strides, box, estr,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

static bool kb_tma_ok(const void* ptr, const long long* s) {
  if ((reinterpret_cast<uintptr_t>(ptr) & 15) != 0 || s[3] != 1) return false;
  for (int i = 0; i < 3; ++i)
    if (s[i] <= 0 || (s[i] * 2) % 16 != 0 || s[i] * 2 >= (1ll << 40)) return false;
  return true;
}

extern "C" const char* kb_sm90_error_string(int code) {
  switch (code) {
@ERROR_CASES@
    default: return cudaGetErrorString(static_cast<cudaError_t>(code));
  }
}

extern "C" int kb_sm90_launch(const KbArgs* args, void* stream) {
  const KbArgs& a = *args;
  if (a.D != KB_HEAD_DIM) return 10001;
  if (a.Hkv <= 0 || a.Hq <= 0 || a.Hq % a.Hkv != 0 || a.B < 0 || a.M < 0 || a.N < 0) return 10003;
  if (a.M >= (1ll << 31) || a.N >= (1ll << 31) || a.Hq >= 65536 || a.B >= 65536) return 10005;
  if (a.B == 0 || a.M == 0) return 0;
  if (!kb_tma_ok(a.q, a.q_stride) || !kb_tma_ok(a.k, a.k_stride) || !kb_tma_ok(a.v, a.v_stride)) return 10002;
  if ((reinterpret_cast<uintptr_t>(a.o) & 3) != 0 || a.o_stride[3] != 1 || a.o_stride[0] % 2 || a.o_stride[1] % 2 ||
      a.o_stride[2] % 2)
    return 10002;  // o is stored as 16-bit pairs
  CUtensorMap mq, mk, mv;
  if (!kb_make_map(&mq, a.q, a.q_stride, a.B, a.Hq, a.M, a.D, kb90::BM) ||
      !kb_make_map(&mk, a.k, a.k_stride, a.B, a.Hkv, a.N, a.D, kb90::BN) ||
      !kb_make_map(&mv, a.v, a.v_stride, a.B, a.Hkv, a.N, a.D, kb90::BN))
    return 10004;
  static bool attr_set = false;
  if (!attr_set) {
    cudaError_t e = cudaFuncSetAttribute(kb_sm90_fwd, cudaFuncAttributeMaxDynamicSharedMemorySize, kb90::SMEM_BYTES);
    if (e != cudaSuccess) return e;
    attr_set = true;
  }
  const int num_m_blocks = static_cast<int>((a.M + kb90::BM - 1) / kb90::BM);
  dim3 grid(num_m_blocks, static_cast<unsigned>(a.Hq), static_cast<unsigned>(a.B));
  kb_sm90_fwd<<<grid, kb90::NTHREADS, kb90::SMEM_BYTES, static_cast<cudaStream_t>(stream)>>>(a, mq, mk, mv,
                                                                                         num_m_blocks);
  return static_cast<int>(cudaGetLastError());
}
"""

PRODUCER_REGS = 24
CONSUMER_REGS = 240


def sm90_forward_source(hooks: str, *, head_dim_pad: int, block_m: int = 128, block_n: int = 128,
                        dtype: str = "bf16", overlap: bool = True, pingpong: bool = True) -> str:
    """The complete .cu text for one (head dim, tile shape, schedule) with `hooks` spliced in."""
    cfg = Sm90Config(head_dim_pad, block_m, block_n, dtype, overlap, pingpong)
    cfg.validate()
    elem, ab, tma_dtype, pack, elem2 = _ELEM[dtype]
    wgmma = _wgmma_ss(block_n, ab) + _wgmma_rs(head_dim_pad, ab)
    cases = "\n".join(f'    case {c}: return "{msg}";' for c, msg in ERROR_CODES.items())
    subs = {
        "@BM@": str(block_m), "@BN@": str(block_n), "@HD@": str(head_dim_pad), "@ELEM@": elem, "@ELEM2@": elem2,
        "@PACK@": pack, "@STAGES@": str(cfg.stages), "@OVERLAP@": "true" if overlap else "false",
        "@PINGPONG@": "true" if pingpong else "false", "@TMA_DTYPE@": tma_dtype, "@ERROR_CASES@": cases,
        "@PRODUCER_REGS@": str(PRODUCER_REGS), "@CONSUMER_REGS@": str(CONSUMER_REGS),
    }
    text = _PRELUDE + _DEVICE + "namespace kb90 {\n" + wgmma + "}  // namespace kb90\n" + _KERNEL + _HOST
    for key, val in subs.items():
        text = text.replace(key, val)
    return text.replace("@HOOKS@", hooks).lstrip("\n")  # hooks last: their text is not substituted
