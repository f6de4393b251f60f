"""Program -> CUDA C++ on the tensor cores, in FlashAttention-2's code shape (sm80 and later).

The statement structure of a flash-attention forward Program decides the code, as in
`kb.lower.cuda`, but tiles live where FA2 keeps them: Q, K and V in swizzled shared memory
filled by `cp.async`, scores, the output accumulator and the softmax state in registers as
`mma.sync.m16n8k16` fragments. What the lowering accepts (anything else raises `KBError`,
and the caller keeps the portable SIMT lowering):

    let* | load Q [.., q0:+BLOCK_M, :] | init m, l, acc
    for n in range(lo, hi, BLOCK_N) (forward or reverse), body:
        [if block(..) is not empty:]  load K, load V (in either order)
                                      dot s = Q @ trans(K)
                                      (elementwise s = f(s) | score_mod s | mask s | if block(..) ...)*
                                      online_softmax (m, l, acc) += s @ V
    (let | for ...)* | finalize o, lse | store o | store lse

Code shape (FA2's `flash_fwd_kernel.h`, Kernel_traits<kHeadDim, kBlockM, kBlockN, kNWarps>):
- One CTA per (b, h, query block); each warp owns BLOCK_M / num_warps query rows (16 or 32,
  i.e. KB_MT m16 tiles). Q is loaded once; per KV block, K then V stream into one buffer each:
  V(j) is fetched while S = Q K(j)^T and the softmax run, K(j+1) while O += P V(j) runs.
- Shared tiles are [rows, HEAD_PAD] with 16-byte chunks XOR-swizzled by row (`kb_swz`), so the
  `ldmatrix` reads of 8 rows hit 8 distinct bank groups; out-of-range rows and columns >= D are
  zero-filled by `cp.async`'s src-size operand.
- S fragments: thread `lane` of a warp holds rows lane/4 and lane/4 + 8 of each m16 tile and
  columns 2*(lane%4), +1 of each n8 tile (the m16n8 C layout). The variant statements run on
  those elements with q_idx/kv_idx computed from that layout; `if block(..)` tests are uniform
  over the CTA. The row max is reduced over the 4 threads of a quad (`shfl.xor` 1, 2); the row
  sum stays thread-partial until `finalize` (the rescale factor is the same across the quad).
- P is re-packed from the S registers into the A operand of the P V mma (the C layout of two
  n8 tiles is the A layout of one k16 slice), V is read with `ldmatrix.trans`.
- Fully masked rows: the exponent subtracts 0 while the row max is -inf, and finalize gives
  o = 0 and lse = -inf, as the IR says.

Host interface: `kb.lower.cuda`'s (`kb_launch`, `LaunchAbi`, the block-class table), plus a layout
check: q/k/v need D % 8 == 0, unit last stride, 16-byte aligned rows (`KB_ERR_LAYOUT` otherwise).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

from kb.errors import KBError
from kb.ir.expr import Expr, ExprOp, const, free_vars, var

from kb.ir.nodes import (
    BlockClass, Dot, Dtype, Elementwise, Finalize, For, Full, IfBlock, Init, Kernel, Let, Load, Mask, OnlineSoftmax,
    Program, Role, ScoreMod, Span, Stmt, Store, VALUE_DIM,
)
from kb.lower.cuda import (
    CTYPE, EXPR_HELPERS, KERNEL_HELPERS, LAUNCH_SYMBOL, PREAMBLE, CudaKernelGen, arg_locals, args_struct, cxx_name,
    host_entry, kernel_symbol, launch_abi, schedule_constants, table_helpers,
)
from kb.lower.cuda_expr import IntWidth, lower_cexpr
from kb.lower.cuda_range import KB_DIM_LIMIT, KB_ERR_RANGE, UNBOUNDED, Ival, fits32, hoistable, ival, narrow_ints, shift
from kb.lower.expr_context import Kind, Sym, expr_kind, is_nonneg
from kb.lower.block_mask import plan_block_mask

__all__ = ["MmaTraits", "lower_program_mma", "with_traits", "KB_ERR_LAYOUT", "FA2_TRAITS"]

KB_ERR_LAYOUT = -2
_LOG2E = "1.4426950408889634f"
_MMA_TYPE = {Dtype.BF16: "bf16", Dtype.F16: "f16"}


@dataclass(frozen=True)
class MmaTraits:
    """FA2's kernel traits: the query/key tile and the warps of one CTA."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4

    def check(self) -> None:
        rows = self.block_m // max(1, self.num_warps)
        if rows * self.num_warps != self.block_m or rows not in (16, 32) or self.block_n % 16 or self.block_n < 16:
            raise KBError(f"tensor-core traits {self}: each warp must own 16 or 32 query rows and BLOCK_N must be "
                          "a multiple of 16")

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps}"


# Starting points per head-dim bucket, FA2's sm80 forward launch templates (kBlockM, kBlockN, kNWarps);
# `kb tune` measurements replace them per GPU.
FA2_TRAITS = {32: MmaTraits(128, 128, 4), 64: MmaTraits(128, 64, 4), 128: MmaTraits(128, 64, 4),
              256: MmaTraits(64, 64, 4)}


def with_traits(p: Program, traits: MmaTraits) -> Program:
    """`p` with the schedule constants the tensor-core kernel is built for (BLOCK_M/N enter the IR's bounds)."""
    traits.check()
    s = dataclasses.replace(p.schedule, block_m=traits.block_m, block_n=traits.block_n, num_warps=traits.num_warps)
    return dataclasses.replace(p, schedule=s)


# ------------------------------------------------------------------ device building blocks

_MMA_HELPERS = r"""
#include <stdint.h>
// byte offset -> shared-state-space address for PTX
__device__ __forceinline__ uint32_t kb_smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
// 16-byte async copy; src_bytes = 0 zero-fills the destination without reading
__device__ __forceinline__ void kb_cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(kb_smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void kb_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void kb_cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
// `a`: a shared-state-space byte address (kb_smem_addr)
__device__ __forceinline__ void kb_ldmatrix_x4(uint32_t (&r)[4], uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void kb_ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// d += a (16x16, row) * b (16x8, col); fp32 accumulate. Registers only, so not volatile: the compiler may
// sink it below later ldmatrix loads (which stay in order), overlapping shared-memory latency with the mma
__device__ __forceinline__ void kb_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.KB_MMA_T.KB_MMA_T.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 2^x on the SFU (flush-to-zero; -inf gives 0), what FA2 gets from exp2f under --use_fast_math
__device__ __forceinline__ float kb_exp2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ uint32_t kb_pack(float lo, float hi) {
  KB_T2 v = KB_PACK2(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
// element offset of (row, 16-byte chunk) in a [rows, HP] tile: chunks XOR-swizzled so that the
// 8 row addresses of one ldmatrix phase land in 8 distinct 16-byte bank groups
template <int HP> __device__ __forceinline__ int kb_swz(int row, int chunk) {
  constexpr int CPR = HP / 8;
  constexpr int RPG = CPR >= 8 ? 1 : 8 / CPR;  // rows that share one 128-byte line
  constexpr int MASK = CPR >= 8 ? 7 : CPR - 1;
  return row * HP + ((chunk ^ ((row / RPG) & MASK)) << 3);
}
// ldmatrix addresses without per-load swizzle math. The lanes of one ldmatrix.x4 read rows R0 + row(lane) and
// 16-byte chunks C0 + hi(lane), with R0 a multiple of 8 and C0 even, both compile-time after unrolling. Rows 8 apart
// share their swizzle, so the XOR term u(lane) = (row / RPG) & MASK < 8 does not see R0, and
// (C0 + hi) ^ u = (C0 & ~7) + (((C0 & 7) + hi) ^ u): each lane needs 4 base addresses, one per (C0 & 7) / 2, and
// R0 and C0 & ~7 become an immediate offset (kb_swz_imm) that ptxas folds into the ldmatrix address.
template <int HP> __device__ __forceinline__ void kb_swz_bases(uint32_t (&o)[4], uint32_t tile, int row, int hi) {
  #pragma unroll
  for (int j = 0; j < 4; ++j) o[j] = tile + kb_swz<HP>(row, 2 * j + hi) * (uint32_t)sizeof(KB_T);
}
// the byte offset of (R0, C0) from the base kb_swz_bases gave for (C0 & 7) / 2
template <int HP> __device__ __forceinline__ constexpr uint32_t kb_swz_imm(int r0, int c0) {
  return (uint32_t)((r0 * HP + (c0 & ~7) * 8) * (int)sizeof(KB_T));
}
// rows [row0, row0 + ROWS) x cols [0, HP) of a tensor (row r at base + off + r * rs) into a swizzled tile;
// rows outside [0, nrows) and columns >= D are zero-filled. Thread t copies chunk t % CPR of rows t / CPR + k * RSTEP:
// one 64-bit source pointer stepping by RSTEP rows, and (RSTEP a multiple of 8) one destination plus immediates.
template <int ROWS, int HP>
__device__ __forceinline__ void kb_load_tile(KB_T* tile, const KB_T* base, long long off, long long row0,
                                             long long nrows, long long rs, long long D) {
  constexpr int CPR = HP / 8;
  static_assert(KB_THREADS % CPR == 0, "a pass of the CTA covers whole rows");
  constexpr int RSTEP = KB_THREADS / CPR;
  const int r0 = threadIdx.x / CPR, c = threadIdx.x % CPR;
  const bool col_ok = c * 8 < D;
  const KB_T* src = base + off + (row0 + r0) * rs + c * 8;
  #pragma unroll
  for (int it = 0; it < (ROWS + RSTEP - 1) / RSTEP; ++it) {
    const int r = r0 + it * RSTEP;
    if (ROWS % RSTEP != 0 && r >= ROWS) break;
    const long long gr = row0 + r;
    const bool ok = col_ok && gr >= 0 && gr < nrows;
    KB_T* dst = RSTEP % 8 == 0 ? tile + kb_swz<HP>(r0, c) + it * RSTEP * HP : tile + kb_swz<HP>(r, c);
    kb_cp_async16(dst, ok ? src + it * RSTEP * rs : base, ok);
  }
}
""".strip("\n")


@dataclass(frozen=True)
class _TileRef:
    """Where a 2-D [rows, :] tile of a tensor starts: `off` (the other dims), `row0`, the row count and stride."""

    tensor: str
    off: str
    row0: str
    nrows: str
    row_stride: str
    col_stride: str


class _MmaGen(CudaKernelGen):
    """FA2-shaped kernel body: see the module docstring for what it accepts."""

    def __init__(self, p: Program, k: Kernel, abi, plan) -> None:
        super().__init__(p, k, abi, plan)
        self.role: dict[str, str] = {}  # IR tile name -> q | s | m | l | acc | o | lse
        self.q_tile: str | None = None
        self.tensors_read: set[str] = set()  # tensors whose tiles cp.async reads (the layout check covers them)
        # bounds of the uniform integer names (dims up to KB_DIM_LIMIT, checked by the launcher)
        self.ivals: dict[str, Ival] = {d: (0, KB_DIM_LIMIT) for d in abi.dims}
        sch = p.schedule
        self.ivals.update(BLOCK_M=(sch.block_m,) * 2, BLOCK_N=(sch.block_n,) * 2, NUM_SPLITS=(sch.num_splits,) * 2,
                          HEAD_PAD=(16, 256))
        self.aux_dtype = {t.name: t.dtype for t in abi.tensors if t.role is Role.AUX}
        self.hoisted = 0

    # -- recognising the structure
    def fail(self, what: str) -> KBError:
        return KBError(f"tensor-core lowering of {self.p.name}: {what} is outside the flash-forward structure "
                       "it accepts (see kb/lower/cuda_mma.py); the portable CUDA lowering still applies")

    def tile_ref(self, tensor: str, index: tuple, rows: str, role: Role = Role.IN) -> _TileRef:
        """The [rows, :] tile `tensor[index]`: scalar indices, one span of `rows` rows, then `:` over the head dim."""
        prm = self.p.param(tensor)
        spans = [i for i, it in enumerate(index) if isinstance(it, Span)]
        if prm.role is not role or len(index) != len(prm.shape) or not isinstance(index[-1], Full) \
                or str(prm.shape[-1]) != "D" or len(spans) != 1 or str(index[spans[0]].size) != rows \
                or any(isinstance(it, (Span, Full)) for i, it in enumerate(index[:-1]) if i != spans[0]):
            raise self.fail(f"the tile {tensor}[...] (scalar indices, one span of {rows} rows, then `:` over D)")
        r, last = spans[0], len(index) - 1
        if role is Role.IN:
            self.tensors_read.add(tensor)
        stride = f"kb_a.{cxx_name(tensor)}_stride"
        terms = [f"({self.ex(it)}) * {stride}[{i}]" for i, it in enumerate(index[:-1]) if i != r]
        return _TileRef(tensor, " + ".join(terms) or "0LL", f"({self.ex(index[r].start)})",
                        cxx_name(str(prm.shape[r])), f"{stride}[{r}]", f"{stride}[{last}]")

    # -- integer ranges of the uniform scalars
    def ival(self, e: Expr, env: Mapping[str, Ival] | None = None) -> Ival:
        return ival(e, self.ivals if env is None else env, self.aux_dtype)

    def decode_grid(self) -> None:
        super().decode_grid()
        for a in self.k.grid:
            hi = self.ival(a.extent)[1]
            self.ivals[a.name] = (0, None if hi is None else hi - 1)

    def bind_scalar(self, name: str, e: Expr) -> None:
        # a reassigned or loop-carried scalar could leave the first value's range: unbounded then
        again = self.declared(cxx_name(name)) or name in self.ivals or self.in_scores
        super().bind_scalar(name, e)
        self.ivals[name] = UNBOUNDED if again else self.ival(e)

    # -- fragments
    def frag_elems(self) -> Iterator[None]:
        """Unrolled loops over this thread's score elements; binds kb_fr/kb_fc (tile row, col) and kb_sv."""
        self.emit("#pragma unroll")
        with self.indent("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)"):
            self.emit("#pragma unroll")
            with self.indent("for (int kb_ni = 0; kb_ni < KB_NT; ++kb_ni)"):
                self.emit("#pragma unroll")
                with self.indent("for (int kb_e = 0; kb_e < 4; ++kb_e)"):
                    self.emit("[[maybe_unused]] const int kb_fr = kb_row0 + kb_mi * 16 + kb_lane / 4 + (kb_e / 2) * 8;")
                    self.emit("[[maybe_unused]] const int kb_fc = kb_ni * 8 + (kb_lane % 4) * 2 + (kb_e % 2);")
                    self.emit("float& kb_sv = kb_s[kb_mi][kb_ni][kb_e];")
                    yield

    def score_names(self) -> dict[str, Sym]:
        names = dict(self.names)
        names[self.s_name] = Sym("kb_sv", Kind.FLOAT)
        return names

    # -- statements
    def s_load(self, st: Load) -> None:
        if self.q_tile is not None or st.out != self.q_name:
            raise self.fail(f"load {st.out} outside the KV loop")
        ref = self.tile_ref(st.tensor, st.index, "BLOCK_M")
        self.q_tile = st.out
        self.role[st.out] = "q"
        self.emit(f"// load {st.out} = {st.tensor}[...]: cp.async into swizzled shared memory (waited on in the KV loop)")
        self.emit(f"kb_load_tile<BLOCK_M, HEAD_PAD>(kb_sQ, kb_a.{cxx_name(st.tensor)}, {ref.off}, {ref.row0}, {ref.nrows}, "
                  f"{ref.row_stride}, D);")
        self.emit("kb_cp_commit();")

    def s_init(self, st: Init) -> None:
        role = {self.sm.m: "m", self.sm.l: "l", self.sm.acc: "acc"}.get(st.out)
        want = {"m": float("-inf"), "l": 0.0, "acc": 0.0}
        if role is None or st.fill != want[role] or st.dtype is not Dtype.F32:
            raise self.fail(f"init {st.out}")
        self.role[st.out] = role
        if role == "acc":
            self.emit(f"float kb_o[KB_MT][KB_DT][4];  // {st.out}: the output accumulator as m16n8 C fragments")
            self.emit("#pragma unroll")
            self.emit("for (int i = 0; i < KB_MT; ++i) for (int j = 0; j < KB_DT; ++j) for (int e = 0; e < 4; ++e) kb_o[i][j][e] = 0.0f;")
        else:
            fill = "-INFINITY" if role == "m" else "0.0f"
            note = "running row max" if role == "m" else "running row sum (thread-partial over the quad)"
            self.emit(f"float kb_{role}[KB_MT][2];  // {st.out}: {note}, rows lane/4 and lane/4 + 8 of each m16 tile")
            self.emit(f"for (int i = 0; i < KB_MT; ++i) kb_{role}[i][0] = kb_{role}[i][1] = {fill};")

    def s_elementwise(self, st: Elementwise) -> None:
        used = {n for n in free_vars(st.value) if n in self.role or n in self.tiles}
        if not used and st.out not in self.role:
            self.bind_scalar(st.out, st.value)
            return
        if st.out != self.s_name or used != {self.s_name}:
            raise self.fail(f"elementwise {st.out} = {st.value}")
        self.emit(f"// elementwise {st.out} = {st.value}: on the score fragments")
        ctx = self.ctx(self.score_names())
        value = lower_cexpr(st.value, ctx)
        if expr_kind(st.value, ctx) is not Kind.FLOAT:
            value = f"((float)({value}))"
        for _ in self.frag_elems():
            self.emit(f"kb_sv = {value};")

    def s_scoremod(self, st: ScoreMod) -> None:
        if st.tile != self.s_name or self.p.score_mod is None:
            raise self.fail(f"score_mod {st.tile}")
        self.emit(f"// score_mod {st.tile}: {self.p.score_mod.body}")
        self.variant(st, self.p.score_mod.body, lambda v, kind: f"kb_sv = {v if kind is Kind.FLOAT else f'((float)({v}))'};")

    def s_mask(self, st: Mask) -> None:
        mask_mod = self.p.mask_mod if st.use_mask_mod else None
        if st.tile != self.s_name or (st.use_mask_mod and mask_mod is None):
            raise self.fail(f"mask {st.tile}")
        self.emit(f"// mask {st.tile}: kv_idx < {self.n_dim}" + (f" & ({mask_mod.body})" if mask_mod is not None else ""))
        n = const(int(self.n_dim)) if self.n_dim.isdigit() else var(self.n_dim)
        keep = var("kv_idx") < n
        if mask_mod is not None:
            keep = keep & mask_mod.body
        self.variant(st, keep, lambda v, kind: f"if (!{v}) kb_sv = -INFINITY;")

    def variant(self, st: ScoreMod | Mask, body: Expr, assign: Callable[[str, Kind], str]) -> None:
        """`body` (a score_mod or the mask's keep test, over b, h, q_idx, kv_idx, score) on this thread's score
        elements. Subexpressions free of `score` are hoisted: uniform ones once, q_idx-only ones once per fragment
        row (2 * KB_MT per thread), kv_idx-only ones once per fragment column (2 per n8 tile); integers are 32-bit
        wherever their ranges provably fit (q_idx < M + BLOCK_M, kv_idx < N + BLOCK_N with dims <= KB_DIM_LIMIT)."""
        if st.at.head_rows:
            raise KBError(f"{st.op.value} {st.tile}: tile rows as query heads (a grouped decode) have no CUDA lowering")
        names = {d: self.names[d] for d in self.abi.dims}
        names.update({q.name: self.names[q.name] for q in self.scalar_params})
        env = {d: self.ivals[d] for d in self.abi.dims}
        for v in ("b", "h"):
            e = getattr(st.at, v)
            names[v] = Sym(f"({self.ex(e)})", Kind.INT, is_nonneg(e, self.ctx()))
            env[v] = self.ival(e)
        qs, ks = self.ival(st.at.q_start), self.ival(st.at.kv_start)
        env["q_idx"], env["kv_idx"] = shift(qs, 0, self.p.schedule.block_m - 1), shift(ks, 0, self.p.schedule.block_n - 1)
        q32, k32 = fits32(qs) and fits32(env["q_idx"]), fits32(ks) and fits32(env["kv_idx"])
        names["q_idx"] = Sym("kb_qi", Kind.INT, is_nonneg(st.at.q_start, self.ctx()))
        names["kv_idx"] = Sym("kb_ki", Kind.INT, is_nonneg(st.at.kv_start, self.ctx()))
        names["score"] = Sym("kb_sv", Kind.FLOAT)
        int_codes = {c for c, ok in (("kb_qi", q32), ("kb_ki", k32)) if ok}

        def kind(e: Expr) -> Kind:
            return expr_kind(e, self.ctx(names))

        narrow = narrow_ints(env, self.aux_dtype, kind)  # reads env and names as define() extends them

        levels: dict[str, list[tuple[str, Expr]]] = {"uniform": [], "row": [], "col": []}

        def hoist(e: Expr) -> Expr:
            dep = free_vars(e) & {"q_idx", "kv_idx", "score"}
            if e.op not in (ExprOp.CONST, ExprOp.VAR) and len(dep) <= 1 and "score" not in dep and hoistable(e, kind):
                self.hoisted += 1
                name = f"kb_h{self.hoisted}"
                levels["uniform" if not dep else "row" if "q_idx" in dep else "col"].append((name, e))
                return var(name)

            return Expr(e.op, tuple(hoist(a) for a in e.args), e.value) if e.args else e

        elem = hoist(body)
        ctype = {Kind.FLOAT: "float", Kind.BOOL: "bool"}
        coord = {"kb_qi": (st.at.q_start, q32), "kb_ki": (st.at.kv_start, k32)}

        def decl(var: str, offset: str) -> str:
            start, small = coord[var]
            ty, cast = ("int", f"(int)({self.ex(start)})") if small else ("long long", self.ex(start))
            return f"[[maybe_unused]] const {ty} {var} = {cast} + {offset};"

        def define(name: str, e: Expr, ref: str) -> str:
            """Declare hoisted value `name` (read as `ref` from then on); returns its C++ type."""
            k = kind(e)
            ty = ctype.get(k) or ("int" if narrow(e) else "long long")
            names[name] = Sym(ref, k, is_nonneg(e, self.ctx(names)) if k is Kind.INT else False)
            env[name] = self.ival(e, env)
            if ty == "int":
                int_codes.add(ref)
            return ty

        def value(e: Expr) -> str:
            return lower_cexpr(e, self.ctx(names), IntWidth(narrow, frozenset(int_codes)))

        self.emit("{")
        with self.indent():
            for name, e in levels["uniform"]:
                ty = ctype.get(kind(e)) or ("int" if narrow(e) else "long long")
                self.emit(f"const {ty} {name} = {value(e)};  // uniform: {e}")
                define(name, e, name)
            rows = levels["row"]
            if rows:
                self.emit(f"// per fragment row (rows lane/4, lane/4 + 8 of each m16 tile): {'; '.join(str(e) for _, e in rows)}")
                types = [define(n, e, f"{n}[kb_mi][kb_hf]") for n, e in rows]
                self.emit(" ".join(f"{ty} {n}[KB_MT][2];" for ty, (n, _) in zip(types, rows)))
                self.emit("#pragma unroll")
                with self.indent("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)"):
                    self.emit("#pragma unroll")
                    with self.indent("for (int kb_hf = 0; kb_hf < 2; ++kb_hf)"):
                        self.emit(decl("kb_qi", "kb_row0 + kb_mi * 16 + kb_lane / 4 + kb_hf * 8"))
                        for n, e in rows:
                            self.emit(f"{n}[kb_mi][kb_hf] = {value(e)};")
                for n, _ in rows:  # the element loop indexes by its own element
                    names[n] = dataclasses.replace(names[n], code=f"{n}[kb_mi][kb_e / 2]")
                    if f"{n}[kb_mi][kb_hf]" in int_codes:
                        int_codes.add(names[n].code)
            cols = levels["col"]
            self.emit("#pragma unroll")
            with self.indent("for (int kb_ni = 0; kb_ni < KB_NT; ++kb_ni)"):
                if cols:
                    self.emit(f"// per fragment column (columns 2 * (lane % 4), +1 of n8 tile ni): "
                              f"{'; '.join(str(e) for _, e in cols)}")
                    types = [define(n, e, f"{n}[kb_cj]") for n, e in cols]
                    self.emit(" ".join(f"{ty} {n}[2];" for ty, (n, _) in zip(types, cols)))
                    self.emit("#pragma unroll")
                    with self.indent("for (int kb_cj = 0; kb_cj < 2; ++kb_cj)"):
                        self.emit(decl("kb_ki", "kb_ni * 8 + (kb_lane % 4) * 2 + kb_cj"))
                        for n, e in cols:
                            self.emit(f"{n}[kb_cj] = {value(e)};")
                    for n, _ in cols:
                        names[n] = dataclasses.replace(names[n], code=f"{n}[kb_e % 2]")
                        if f"{n}[kb_cj]" in int_codes:
                            int_codes.add(names[n].code)
                self.emit("#pragma unroll")
                with self.indent("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)"):
                    self.emit("#pragma unroll  // the C fragment: rows + 8 for e >= 2, column + e % 2")
                    with self.indent("for (int kb_e = 0; kb_e < 4; ++kb_e)"):
                        self.emit("float& kb_sv = kb_s[kb_mi][kb_ni][kb_e];")
                        self.emit(decl("kb_qi", "kb_row0 + kb_mi * 16 + kb_lane / 4 + (kb_e / 2) * 8"))
                        self.emit(decl("kb_ki", "kb_ni * 8 + (kb_lane % 4) * 2 + kb_e % 2"))
                        self.emit(assign(value(elem), kind(elem)))
        self.emit("}")

    def s_ifblock(self, st: IfBlock) -> None:
        if not self.in_scores:
            raise self.fail(f"if block(...) is {st.cls.value} outside the score statements")
        super().s_ifblock(st)

    def s_onlinesoftmax(self, st: OnlineSoftmax) -> None:
        raise self.fail("online_softmax outside its KV loop")

    def s_dot(self, st: Dot) -> None:
        raise self.fail(f"dot {st.out} outside the KV loop")

    def s_finalize(self, st: Finalize) -> None:
        if (st.m, st.l, st.acc) != (self.sm.m, self.sm.l, self.sm.acc):
            raise self.fail(f"finalize {st.o}")
        self.role[st.o], self.role[st.lse] = "o", "lse"
        self.emit(f"// finalize {st.o}, {st.lse}: the row sums are reduced over the quad here, once;"
                  " o = acc / l (0 where l == 0), lse = m + log(l) (-inf where l == 0)")
        self.emit("float kb_lse[KB_MT][2];")
        self.emit("#pragma unroll")
        with self.indent("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)"):
            self.emit("#pragma unroll")
            with self.indent("for (int kb_hf = 0; kb_hf < 2; ++kb_hf)"):
                self.emit("float kb_sum = kb_l[kb_mi][kb_hf];")
                self.emit("kb_sum += __shfl_xor_sync(0xffffffffu, kb_sum, 1);")
                self.emit("kb_sum += __shfl_xor_sync(0xffffffffu, kb_sum, 2);")
                self.emit("const float kb_inv = kb_sum == 0.0f ? 1.0f : 1.0f / kb_sum;")
                self.emit("kb_lse[kb_mi][kb_hf] = kb_sum == 0.0f ? -INFINITY : kb_m[kb_mi][kb_hf] + logf(kb_sum);")
                self.emit("#pragma unroll")
                self.emit("for (int kb_dj = 0; kb_dj < KB_DT; ++kb_dj) { kb_o[kb_mi][kb_dj][2 * kb_hf] *= kb_inv; "
                          "kb_o[kb_mi][kb_dj][2 * kb_hf + 1] *= kb_inv; }")

    def s_store(self, st: Store) -> None:
        role = self.role.get(st.value)
        if role == "o":
            self.store_o(st)
        elif role == "lse":
            self.store_lse(st)
        else:
            raise self.fail(f"store {st.tensor} = {st.value}")

    def store_o(self, st: Store) -> None:
        ref = self.tile_ref(st.tensor, st.index, "BLOCK_M", Role.OUT)
        ctype = CTYPE[self.p.param(st.tensor).dtype]
        self.emit(f"// store {st.tensor}[...] = {st.value}: straight from the fragments")
        self.emit(f"{ctype}* kb_op = kb_a.{cxx_name(st.tensor)} + {ref.off};")
        self.emit("#pragma unroll")
        with self.indent("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)"):
            self.emit("#pragma unroll")
            with self.indent("for (int kb_hf = 0; kb_hf < 2; ++kb_hf)"):
                self.emit(f"const long long kb_gr = {ref.row0} + kb_row0 + kb_mi * 16 + kb_lane / 4 + kb_hf * 8;")
                self.emit(f"if (kb_gr < 0 || kb_gr >= {ref.nrows}) continue;")
                self.emit("#pragma unroll")
                with self.indent("for (int kb_dj = 0; kb_dj < KB_DT; ++kb_dj)"):
                    self.emit("const int kb_c = kb_dj * 8 + (kb_lane % 4) * 2;")
                    self.emit("if (kb_c >= D) continue;  // D % 8 == 0: the pair is in range together")
                    self.emit(f"{ctype}* kb_dst = kb_op + kb_gr * {ref.row_stride} + kb_c * {ref.col_stride};")
                    self.emit(f"kb_dst[0] = kb_cvt<{ctype}>(kb_o[kb_mi][kb_dj][2 * kb_hf]);")
                    self.emit(f"kb_dst[{ref.col_stride}] = kb_cvt<{ctype}>(kb_o[kb_mi][kb_dj][2 * kb_hf + 1]);")

    def store_lse(self, st: Store) -> None:
        prm = self.p.param(st.tensor)
        scalars, rows = [it for it in st.index[:-1] if isinstance(it, Expr)], st.index[-1]
        if prm.role is not Role.OUT or prm.dtype is not Dtype.F32 or len(scalars) != len(st.index) - 1 \
                or not isinstance(rows, Span) or str(rows.size) != "BLOCK_M":
            raise self.fail(f"store {st.tensor} = {st.value}")
        r = len(scalars)
        off = " + ".join(f"({self.ex(it)}) * kb_a.{cxx_name(st.tensor)}_stride[{i}]" for i, it in enumerate(scalars)) or "0LL"
        self.emit(f"// store {st.tensor}[...] = {st.value}: one lane of each quad writes its rows")
        with self.indent("if (kb_lane % 4 == 0)"):
            self.emit("#pragma unroll")
            with self.indent("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)"):
                self.emit("#pragma unroll")
                with self.indent("for (int kb_hf = 0; kb_hf < 2; ++kb_hf)"):
                    self.emit(f"const long long kb_gr = ({self.ex(rows.start)}) + kb_row0 + kb_mi * 16 + kb_lane / 4 + kb_hf * 8;")
                    self.emit(f"if (kb_gr >= 0 && kb_gr < {cxx_name(str(prm.shape[r]))}) "
                              f"kb_a.{cxx_name(st.tensor)}[{off} + kb_gr * kb_a.{cxx_name(st.tensor)}_stride[{r}]] = kb_lse[kb_mi][kb_hf];")

    # -- the KV loop
    def s_for(self, st: For) -> None:
        skip, inner = None, st.body
        if len(inner) == 1 and isinstance(inner[0], IfBlock) and inner[0].cls is BlockClass.EMPTY and inner[0].negate \
                and not inner[0].orelse:
            skip, inner = inner[0], inner[0].then
        loads = [s for s in inner[:2] if isinstance(s, Load)]
        if len(loads) != 2 or len(inner) < 4 or not isinstance(inner[2], Dot) or not isinstance(inner[-1], OnlineSoftmax):
            raise self.fail(f"the body of `for {st.var}` (load K, load V, dot, score statements, online_softmax)")
        dot, sm = inner[2], inner[-1]
        by_name = {ld.out: ld for ld in loads}
        if not dot.trans_b or dot.trans_a or dot.a != self.q_tile or dot.b not in by_name or sm.values not in by_name \
                or dot.b == sm.values or sm.scores != dot.out or (sm.m, sm.l, sm.acc) != (self.sm.m, self.sm.l, self.sm.acc):
            raise self.fail(f"the dot/online_softmax pair of `for {st.var}`")
        if st.order not in ("forward", "reverse") or str(st.step) != "BLOCK_N":
            raise self.fail(f"`for {st.var}` with step {st.step} / order {st.order}")
        self.s_name = dot.out
        self.role[dot.out] = "s"
        n = cxx_name(st.var)
        self.names[st.var] = Sym(n, Kind.INT)
        lo, hi = self.ival(st.lo)[0], self.ival(st.hi)[1]
        self.ivals[st.var] = (lo, None if hi is None else hi - 1)
        kref, vref = self.tile_ref(by_name[dot.b].tensor, by_name[dot.b].index, "BLOCK_N"), \
            self.tile_ref(by_name[sm.values].tensor, by_name[sm.values].index, "BLOCK_N")
        self.emit(f"// for {st.var} in range({st.lo}, {st.hi}, {st.step}) {st.order}: K(j+1) and V(j) in flight under the mma")
        self.emit("{")
        with self.indent():
            self.emit(f"const long long kb_lo = {self.ex(st.lo)}, kb_hi = {self.ex(st.hi)};")
            self.emit("const long long kb_n_iter = kb_hi > kb_lo ? kb_cdiv(kb_hi - kb_lo, BLOCK_N) : 0;")
            at = "kb_lo + kb_i * BLOCK_N" if st.order == "forward" else "kb_lo + (kb_n_iter - 1 - kb_i) * BLOCK_N"
            self.emit(f"auto kb_n_at = [&](long long kb_i) -> long long {{ return {at}; }};")
            self.emit(f"auto kb_load_k = [&](long long {n}) {{ kb_load_tile<BLOCK_N, HEAD_PAD>(kb_sK, kb_a.{cxx_name(kref.tensor)}, "
                      f"{kref.off}, {kref.row0}, {kref.nrows}, {kref.row_stride}, D); kb_cp_commit(); }};")
            self.emit(f"auto kb_load_v = [&](long long {n}) {{ kb_load_tile<BLOCK_N, HEAD_PAD>(kb_sV, kb_a.{cxx_name(vref.tensor)}, "
                      f"{vref.off}, {vref.row0}, {vref.nrows}, {vref.row_stride}, D); kb_cp_commit(); }};")
            if skip is not None:
                self.emit("// iterations whose block is empty are skipped, prefetch included")
                saved, depth = self.lines, self.depth
                self.lines, self.depth = [], 1
                cond = self.block_condition(skip)
                body, self.lines, self.depth = self.lines, saved, depth
                self.emit(f"auto kb_live = [&](long long {n}) -> bool {{")
                self.lines += ["  " * depth + ln for ln in body]
                self.emit(f"  return {cond};")
                self.emit("};")
                self.emit("auto kb_next = [&](long long kb_i) -> long long { while (kb_i < kb_n_iter && !kb_live(kb_n_at(kb_i))) ++kb_i; return kb_i; };")
            else:
                self.emit("auto kb_next = [&](long long kb_i) -> long long { return kb_i; };")
            self.emit("long long kb_it = kb_next(0);")
            self.emit("if (kb_it < kb_n_iter) kb_load_k(kb_n_at(kb_it));")
            self.emit("#pragma unroll 1")
            with self.indent("while (kb_it < kb_n_iter)"):
                self.emit(f"const long long {n} = kb_n_at(kb_it);")
                self.emit("const long long kb_it_next = kb_next(kb_it + 1);")
                self.emit(f"kb_load_v({n});")
                self.emit("kb_cp_wait<1>();  // Q and K(j) have landed; V(j) may still be in flight")
                self.emit("__syncthreads();")
                self.qk()
                self.in_scores = True
                self.block(inner[3:-1])
                self.in_scores = False
                self.softmax()
                self.emit("kb_cp_wait<0>();  // V(j)")
                self.emit("__syncthreads();  // every warp is done with K(j) and sees V(j)")
                self.emit("if (kb_it_next < kb_n_iter) kb_load_k(kb_n_at(kb_it_next));")
                self.pv()
                self.emit("__syncthreads();  // every warp is done with V(j) before V(j+1) lands")
                self.emit("kb_it = kb_it_next;")
        self.emit("}")
        del self.names[st.var]

    def qk(self) -> None:
        self.emit(f"// dot {self.s_name} = Q @ trans(K): m16n8k16 mma, A and B by ldmatrix from the swizzled tiles")
        self.emit("float kb_s[KB_MT][KB_NT][4];")
        self.emit("#pragma unroll")
        self.emit("for (int i = 0; i < KB_MT; ++i) for (int j = 0; j < KB_NT; ++j) for (int e = 0; e < 4; ++e) kb_s[i][j][e] = 0.0f;")
        self.emit("#pragma unroll")
        with self.indent("for (int kb_kk = 0; kb_kk < HEAD_PAD / 16; ++kb_kk)"):
            self.emit("uint32_t kb_qa[KB_MT][4];")
            self.emit("#pragma unroll")
            self.emit("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)")
            self.emit("  kb_ldmatrix_x4(kb_qa[kb_mi], kb_aq[kb_kk % 4] + kb_swz_imm<HEAD_PAD>(kb_mi * 16, kb_kk * 2));")
            self.emit("#pragma unroll")
            with self.indent("for (int kb_nj = 0; kb_nj < KB_NT / 2; ++kb_nj)"):
                self.emit("uint32_t kb_kb[4];  // B of n8 tiles 2nj (regs 0, 1) and 2nj + 1 (regs 2, 3)")
                self.emit("kb_ldmatrix_x4(kb_kb, kb_ak[kb_kk % 4] + kb_swz_imm<HEAD_PAD>(kb_nj * 16, kb_kk * 2));")
                self.emit("#pragma unroll")
                with self.indent("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)"):
                    self.emit("kb_mma(kb_s[kb_mi][2 * kb_nj], kb_qa[kb_mi], kb_kb[0], kb_kb[1]);")
                    self.emit("kb_mma(kb_s[kb_mi][2 * kb_nj + 1], kb_qa[kb_mi], kb_kb[2], kb_kb[3]);")

    def softmax(self) -> None:
        self.emit("// online softmax on the fragments: row max over the quad, p = exp2(s*log2e - m*log2e), acc *= alpha")
        self.emit("#pragma unroll")
        with self.indent("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)"):
            self.emit("#pragma unroll")
            with self.indent("for (int kb_hf = 0; kb_hf < 2; ++kb_hf)"):
                self.emit("float kb_mx = -INFINITY;")
                self.emit("#pragma unroll")
                self.emit("for (int kb_ni = 0; kb_ni < KB_NT; ++kb_ni) "
                          "kb_mx = fmaxf(kb_mx, fmaxf(kb_s[kb_mi][kb_ni][2 * kb_hf], kb_s[kb_mi][kb_ni][2 * kb_hf + 1]));")
                self.emit("kb_mx = fmaxf(kb_mx, __shfl_xor_sync(0xffffffffu, kb_mx, 1));")
                self.emit("kb_mx = fmaxf(kb_mx, __shfl_xor_sync(0xffffffffu, kb_mx, 2));")
                self.emit("const float kb_m_old = kb_m[kb_mi][kb_hf];")
                self.emit("const float kb_m_new = fmaxf(kb_m_old, kb_mx);")
                self.emit("// rows with no unmasked score yet keep m = -inf; subtract 0 there so exp2 sees -inf, never NaN")
                self.emit(f"const float kb_ms = (kb_m_new == -INFINITY ? 0.0f : kb_m_new) * {_LOG2E};")
                self.emit(f"const float kb_alpha = kb_exp2(fmaf(kb_m_old, {_LOG2E}, -kb_ms));")
                self.emit("kb_m[kb_mi][kb_hf] = kb_m_new;")
                self.emit("float kb_sum = 0.0f;")
                self.emit("#pragma unroll")
                with self.indent("for (int kb_ni = 0; kb_ni < KB_NT; ++kb_ni)"):
                    self.emit("#pragma unroll")
                    with self.indent("for (int kb_e = 2 * kb_hf; kb_e < 2 * kb_hf + 2; ++kb_e)"):
                        self.emit(f"const float kb_p = kb_exp2(fmaf(kb_s[kb_mi][kb_ni][kb_e], {_LOG2E}, -kb_ms));")
                        self.emit("kb_s[kb_mi][kb_ni][kb_e] = kb_p;")
                        self.emit("kb_sum += kb_p;")
                self.emit("kb_l[kb_mi][kb_hf] = kb_l[kb_mi][kb_hf] * kb_alpha + kb_sum;")
                self.emit("#pragma unroll")
                self.emit("for (int kb_dj = 0; kb_dj < KB_DT; ++kb_dj) { kb_o[kb_mi][kb_dj][2 * kb_hf] *= kb_alpha; "
                          "kb_o[kb_mi][kb_dj][2 * kb_hf + 1] *= kb_alpha; }")

    def pv(self) -> None:
        self.emit("// acc += P @ V: P re-packed from the score registers (C layout of two n8 tiles = A layout of one k16 slice)")
        self.emit("#pragma unroll")
        with self.indent("for (int kb_kk = 0; kb_kk < KB_NT / 2; ++kb_kk)"):
            self.emit("uint32_t kb_pa[KB_MT][4];")
            self.emit("#pragma unroll")
            with self.indent("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)"):
                self.emit("kb_pa[kb_mi][0] = kb_pack(kb_s[kb_mi][2 * kb_kk][0], kb_s[kb_mi][2 * kb_kk][1]);")
                self.emit("kb_pa[kb_mi][1] = kb_pack(kb_s[kb_mi][2 * kb_kk][2], kb_s[kb_mi][2 * kb_kk][3]);")
                self.emit("kb_pa[kb_mi][2] = kb_pack(kb_s[kb_mi][2 * kb_kk + 1][0], kb_s[kb_mi][2 * kb_kk + 1][1]);")
                self.emit("kb_pa[kb_mi][3] = kb_pack(kb_s[kb_mi][2 * kb_kk + 1][2], kb_s[kb_mi][2 * kb_kk + 1][3]);")
            self.emit("#pragma unroll")
            with self.indent("for (int kb_dj = 0; kb_dj < KB_DT / 2; ++kb_dj)"):
                self.emit("uint32_t kb_vb[4];  // B of d8 tiles 2dj (regs 0, 1) and 2dj + 1 (regs 2, 3), transposed on load")
                self.emit("kb_ldmatrix_x4_trans(kb_vb, kb_av[kb_dj % 4] + kb_swz_imm<HEAD_PAD>(kb_kk * 16, kb_dj * 2));")
                self.emit("#pragma unroll")
                with self.indent("for (int kb_mi = 0; kb_mi < KB_MT; ++kb_mi)"):
                    self.emit("kb_mma(kb_o[kb_mi][2 * kb_dj], kb_pa[kb_mi], kb_vb[0], kb_vb[1]);")
                    self.emit("kb_mma(kb_o[kb_mi][2 * kb_dj + 1], kb_pa[kb_mi], kb_vb[2], kb_vb[3]);")

    # -- whole kernel
    def generate(self) -> list[str]:
        sms = [s for s in _walk(self.k.body) if isinstance(s, OnlineSoftmax)]
        dots = [s for s in _walk(self.k.body) if isinstance(s, Dot)]
        if not sms or len({(s.m, s.l, s.acc) for s in sms}) != 1 or not dots or len({d.a for d in dots}) != 1:
            raise self.fail("a kernel without one online-softmax state")
        self.sm, self.q_name, self.in_scores, self.s_name = sms[0], dots[0].a, False, ""
        self.decode_grid()
        self.emit("const int kb_row0 = kb_warp * (BLOCK_M / KB_WARPS);  // this warp's first query row in the tile")
        self.emit("// ldmatrix base addresses (kb_swz_bases): Q and V lanes read rows lane % 8 + ((lane / 8) % 2) * 8, chunk "
                  "+ lane / 16; K lanes rows lane % 8 + (lane / 16) * 8, chunk + (lane / 8) % 2")
        self.emit("uint32_t kb_aq[4], kb_ak[4], kb_av[4];")
        self.emit("kb_swz_bases<HEAD_PAD>(kb_aq, kb_smem_addr(kb_sQ), kb_row0 + kb_lane % 8 + ((kb_lane / 8) % 2) * 8, kb_lane / 16);")
        self.emit("kb_swz_bases<HEAD_PAD>(kb_ak, kb_smem_addr(kb_sK), kb_lane % 8 + (kb_lane / 16) * 8, (kb_lane / 8) % 2);")
        self.emit("kb_swz_bases<HEAD_PAD>(kb_av, kb_smem_addr(kb_sV), kb_lane % 8 + ((kb_lane / 8) % 2) * 8, kb_lane / 16);")
        for st in self.k.body:
            if not isinstance(st, (Let, Load, Init, For, Finalize, Store, Elementwise)):
                raise self.fail(f"a top-level {st.op.value}")
            self.visit(st)
        self.emit("kb_cp_wait<0>();")
        return self.lines


def _walk(body: tuple[Stmt, ...]) -> Iterator[Stmt]:
    for st in body:
        yield st
        for sub in ("body", "then", "orelse"):
            yield from _walk(getattr(st, sub, ()))


def _aligned(p: Program, tensor: str) -> str:
    """C++ test: 16-byte aligned base, unit last stride, every other stride a multiple of 8 elements."""
    n, t = len(p.param(tensor).shape), f"kb_a.{cxx_name(tensor)}"
    return " && ".join([f"((unsigned long long){t} & 15) == 0", f"{t}_stride[{n - 1}] == 1",
                        *(f"{t}_stride[{i}] % 8 == 0" for i in range(n - 1))])


def lower_program_mma(p: Program) -> str:
    """FA2-shaped tensor-core CUDA source for `p` with `p.schedule`'s BLOCK_M/BLOCK_N/num_warps (see `with_traits`).

    Raises KBError naming the first construct outside the accepted structure."""
    q = p.param("q")
    if q.dtype not in _MMA_TYPE or p.param("k").dtype is not q.dtype or p.param("v").dtype is not q.dtype:
        raise KBError(f"tensor-core lowering of {p.name}: q, k, v must all be bf16 or fp16 (got {q.dtype.value})")
    if len(p.kernels) != 1 or VALUE_DIM in p.dims() or p.schedule.num_splits != 1:
        raise KBError(f"tensor-core lowering of {p.name}: one forward kernel with one head dim and no split-KV")
    s = p.schedule
    MmaTraits(s.block_m, s.block_n, s.num_warps).check()
    abi = launch_abi(p)
    if abi.head_pad and abi.head_pad < 16:
        raise KBError(f"tensor-core lowering of {p.name}: head_pad {abi.head_pad} < 16")
    plan = plan_block_mask(p)
    k = p.kernels[0]
    gen = _MmaGen(p, k, abi, plan)
    body = gen.generate()
    scalars = [x for x in p.params if x.role is Role.SCALAR]
    threads = s.num_warps * 32
    ctype = CTYPE[q.dtype]
    pack = "__floats2bfloat162_rn" if q.dtype is Dtype.BF16 else "__floats2half2_rn"
    t2 = "__nv_bfloat162" if q.dtype is Dtype.BF16 else "__half2"
    helpers = (_MMA_HELPERS.replace("KB_MMA_T", _MMA_TYPE[q.dtype]).replace("sizeof(KB_T)", f"sizeof({ctype})").replace("KB_T2", t2).replace("KB_PACK2", pack)
               .replace("KB_T*", f"{ctype}*"))
    out = [f"// Tensor-core CUDA kernel for IR program `{p.name}` (FA2 structure, sm80+): generated by kb.lower.cuda_mma, do not edit.",
           f'// Host entry: extern "C" int {LAUNCH_SYMBOL}(ptrs, strides, dims, scalars, stream); see kb/lower/cuda.py.',
           PREAMBLE.strip("\n"), "", EXPR_HELPERS, KERNEL_HELPERS, "",
           *schedule_constants(s),
           f"constexpr int KB_MT = {s.block_m // s.num_warps // 16};  // m16 tiles per warp",
           f"constexpr int KB_NT = {s.block_n // 8};  // n8 tiles of a score row block",
           "constexpr int KB_ERR_HEAD_DIM = -1;",
           f"constexpr int KB_ERR_LAYOUT = {KB_ERR_LAYOUT};",
           f"constexpr int KB_ERR_RANGE = {KB_ERR_RANGE};",
           f"constexpr long long KB_DIM_LIMIT = {KB_DIM_LIMIT};  // 32-bit index math in the score-fragment loops", "",
           helpers, "", *args_struct(abi), ""]
    if abi.table:
        out += [*table_helpers(p, abi, threads), ""]
    elem = f"sizeof({ctype})"
    out += [abi.template, f"struct kb_{k.name}_smem {{",
            f"  static constexpr int q = 0, k = BLOCK_M * HEAD_PAD * {elem}, v = k + BLOCK_N * HEAD_PAD * {elem};",
            f"  static constexpr int bytes = v + BLOCK_N * HEAD_PAD * {elem};", "};", "",
            abi.template,
            f"__global__ void __launch_bounds__({threads}) {kernel_symbol(k)}(const KbArgs kb_a) {{",
            "  constexpr int KB_DT = HEAD_PAD / 8;  // n8 tiles of the head dim",
            "  extern __shared__ __align__(128) unsigned char kb_smem[];",
            f"  {ctype}* kb_sQ = reinterpret_cast<{ctype}*>(kb_smem + kb_{k.name}_smem{abi.targs}::q);",
            f"  {ctype}* kb_sK = reinterpret_cast<{ctype}*>(kb_smem + kb_{k.name}_smem{abi.targs}::k);",
            f"  {ctype}* kb_sV = reinterpret_cast<{ctype}*>(kb_smem + kb_{k.name}_smem{abi.targs}::v);",
            "  [[maybe_unused]] const int kb_warp = threadIdx.x / 32, kb_lane = threadIdx.x % 32;",
            *arg_locals(abi, scalars), *body, "}", ""]
    checks = [_aligned(p, t) for t in sorted(gen.tensors_read)]
    layout = [f"  if (kb_a.D % 8 != 0 || !({' && '.join(checks)})) return KB_ERR_LAYOUT;"]
    dims = " || ".join(f"kb_a.{cxx_name(d)} < 0 || kb_a.{cxx_name(d)} > KB_DIM_LIMIT" for d in abi.dims)
    if dims:
        layout.append(f"  if ({dims}) return KB_ERR_RANGE;")
    out += host_entry(p, abi, [k], scalars, pre_launch=layout,
                 errors={KB_ERR_LAYOUT: "the tensor-core kernel needs D % 8 == 0 and q/k/v with a unit last stride, "
                                        "16-byte aligned rows and strides that are multiples of 8 (call .contiguous())",
                         KB_ERR_RANGE: f"the tensor-core kernel needs every dim <= {KB_DIM_LIMIT} (its score-fragment "
                                       "index math is 32-bit)"})
    return "\n".join(out).rstrip() + "\n"
