"""Program -> CUDA C++ source: one `__global__` kernel per IR kernel plus an `extern "C"` launcher.

Reference-guided: the statement structure of the Program decides the code shape, which for
the FlashAttention-2 forward is one CTA per (b, h, query block), the Q tile in shared memory,
K/V tiles streamed through shared memory by the `for` loop with the IR's exact bounds, S = Q K^T
with fp32 accumulation, the variant expressions inlined per element with q_idx/kv_idx, masked
scores set to -inf, the online softmax (running max, running sum, accumulator rescale) and the
epilogue. A split-KV program becomes its partial kernel and its combine kernel, launched in order.

Code shape (plain SIMT, every tile in dynamic shared memory):
- Each IR tile is a shared buffer in its element type (loads keep the tensor dtype, so bf16
  Q/K/V tiles stay bf16; dots, softmax state and elementwise results are fp32). The last dim of
  a 2-D/3-D tile is padded by one 32-bit word so that column walks in the dots are free of bank
  conflicts; `kb_<kernel>_smem<HEAD_PAD>` holds the byte offsets.
- Elementwise work (load, store, init, elementwise, score_mod, mask, finalize) is a
  block-stride loop over the tile's elements with the last dim fastest, so global loads and
  stores are coalesced along the head dim. Row statistics (reduce over the last axis and the
  online-softmax row max/sum) use one warp per row with shuffles. Dots (S = Q K^T and the
  P V update) read only shared memory, with register micro-tiles of up to 16 x 4 outputs per
  thread where the tile shape allows (`CudaKernelGen.matmul`); fp32 SIMT FMAs, no tensor cores.
- A `__syncthreads()` follows every tile-producing statement (tile statements are barriers);
  scalars (grid axes, `let`, loop variables) are uniform across the CTA, so every loop and `if`
  is uniform and the barriers inside them are legal.
- `if block(...) is CLASS` is decided in closed form when `kb.lower.block_mask.plan_block_mask`
  finds one (causal, sliding window, offsets); otherwise a generated `kb_block_class_kernel`
  evaluates mask_mod over every (BLOCK_M x BLOCK_N) tile on the device first and writes an
  int8 table [B|1, H|1, cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)] (0 empty, 1 partial, 2 full; an
  unaligned tile start reads as partial), the Triton lowering's table semantics.
- HEAD_PAD is a template parameter: the schedule's head_pad when set, else the launcher
  dispatches on max(16, next_pow2(D)) over `HEAD_PADS` (FlashAttention's head-dim dispatch);
  building with `-DKB_HEAD_PAD_ONLY=<hp>` compiles that one instantiation (fast checks). A program
  with a value head dim `Dv` (kb.ir.value_dim) has a second template parameter HEAD_PAD_V,
  dispatched the same way on max(16, next_pow2(Dv)) (`-DKB_HEAD_PAD_V_ONLY=<hpv>` likewise).
- Fully masked rows never produce NaN: the max used in the exponent is 0 while the row max is
  -inf; `finalize` divides by 1 where l == 0 and gives lse = -inf there.

Host interface (chosen over a torch extension so the source needs no torch headers and the
same file builds with plain nvcc): `int kb_launch(void* const* ptrs, const long long* strides,
const long long* dims, const double* scalars, void* stream)` with arrays in `LaunchAbi` order;
outputs, scratch and the block-class table are allocated by the caller (`kb.lower.cuda_runtime`).
It returns 0, a `cudaError_t`, or `KB_ERR_HEAD_DIM`; `kb_error_string(code)` names it.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from kb.errors import KBError
from kb.ir.algebra import next_pow2
from kb.ir.expr import Expr, free_vars
from kb.ir.nodes import (
    BACKWARD_OPS, DOT_MIN_K, Combine, Dot, Dtype, Elementwise, Finalize, For, IfBlock, Init, Kernel, Load, Mask, OnlineSoftmax,
    Param, Program, Reduce, Role, SCHEDULE_CONSTANTS, Schedule, ScoreMod, Span, Stmt, Store, VALUE_DIM, walk_stmts,
)
from kb.ir.visit import StmtVisitor
from kb.lower.block_mask import (
    CLASS_CODE, EMPTY, FULL, PARTIAL, BlockMaskKind, BlockMaskPlan, block_class_test, plan_block_mask,
)
from kb.lower.cuda_expr import EXPR_HELPERS, cxx_type, float_literal, lower_cexpr
from kb.lower.expr_context import DTYPE_KIND, AuxRef, ExprContext, ExprTarget, Kind, Sym, expr_kind, is_nonneg, visible_names
from kb.lower.kernel_gen import KernelGenBase, check_attention_params

__all__ = ["lower_program", "launch_abi", "source_schedule", "LaunchAbi", "TableSpec", "kernel_symbol", "HEAD_PADS",
           "LAUNCH_SYMBOL", "ERROR_SYMBOL", "KB_ERR_HEAD_DIM", "CTYPE", "PREAMBLE", "KERNEL_HELPERS", "CudaKernelGen",
           "cxx_name", "args_struct", "arg_locals", "table_helpers", "fill_args", "host_entry", "schedule_constants"]

HEAD_PADS = (16, 32, 64, 128, 256)
LAUNCH_SYMBOL = "kb_launch"
ERROR_SYMBOL = "kb_error_string"
KB_ERR_HEAD_DIM = -1
KB_ERR_SMEM = -2  # a kernel's shared memory at this head dim exceeds the device's per-block opt-in limit
_LOG2E = "1.4426950408889634f"
CTYPE = {Dtype.F32: "float", Dtype.BF16: "__nv_bfloat16", Dtype.F16: "__half", Dtype.I32: "int",
          Dtype.I64: "long long", Dtype.BOOL: "bool"}
_BYTES = {Dtype.F32: 4, Dtype.BF16: 2, Dtype.F16: 2, Dtype.I32: 4, Dtype.I64: 8, Dtype.BOOL: 1}
_CXX_RESERVED = {
    "auto", "bool", "break", "case", "char", "const", "continue", "default", "delete", "do", "double", "else",
    "enum", "extern", "float", "for", "goto", "if", "inline", "int", "long", "new", "operator", "private",
    "public", "register", "return", "short", "signed", "sizeof", "static", "struct", "switch", "template",
    "this", "throw", "try", "typedef", "union", "unsigned", "void", "volatile", "while", "true", "false",
    "class", "namespace", "using", "virtual", "friend", "protected", "asm", "mutable", "explicit", "export",
    "typename", "typeid", "catch", "nullptr", "constexpr", "decltype", "noexcept", "alignas", "alignof",
    "and", "or", "not", "xor", "min", "max", "exp", "log", "tanh", "sqrt", "abs", "INFINITY", "NAN",
    "threadIdx", "blockIdx", "blockDim", "gridDim", "warpSize", "half", "dim3", "std",
}


def _size_code(d: object) -> str:
    """A tensor dim as C++ code: an int literal or the dim's local name."""
    return str(d) if isinstance(d, int) else cxx_name(str(d))


def kernel_symbol(k: Kernel) -> str:
    return f"kb_{k.name}_kernel"


def cxx_name(ir_name: str) -> str:
    """The C++ spelling of an IR name (IR names never start with `kb_` in generated code)."""
    return f"v_{ir_name}" if ir_name in _CXX_RESERVED or ir_name.startswith(("kb_", "_", "v_")) else ir_name


# ------------------------------------------------------------------ launch ABI


@dataclass(frozen=True)
class TableSpec:
    """The block-class table the caller allocates: int8, contiguous, [nb, nh, nm, nn]."""

    per_b: bool
    per_h: bool
    b_dim: str
    h_dim: str
    m_dim: str
    n_dim: str
    block_m: int
    block_n: int

    def shape(self, dims: Mapping[str, int]) -> tuple[int, int, int, int]:
        cdiv = lambda a, b: -(-a // b)  # noqa: E731
        return (dims[self.b_dim] if self.per_b else 1, dims[self.h_dim] if self.per_h else 1,
                cdiv(dims[self.m_dim], self.block_m), cdiv(dims[self.n_dim], self.block_n))


@dataclass(frozen=True)
class LaunchAbi:
    """Argument order of `kb_launch`: `ptrs` = tensors (+ table), `strides` = each tensor's strides
    concatenated in tensor order, `dims` = runtime dims, `scalars` = scalar params as doubles."""

    program: str
    tensors: tuple[Param, ...]
    dims: tuple[str, ...]
    scalars: tuple[str, ...]
    table: TableSpec | None
    head_pad: int  # the schedule's; 0 = dispatched on D at launch
    value_dim: bool = False  # a value head dim Dv: HEAD_PAD_V is a second template parameter, dispatched on Dv

    @property
    def template(self) -> str:
        """The template parameter list of every kernel, layout and runner."""
        return "template <int HEAD_PAD, int HEAD_PAD_V>" if self.value_dim else "template <int HEAD_PAD>"

    @property
    def targs(self) -> str:
        """The template arguments that pass those parameters on."""
        return "<HEAD_PAD, HEAD_PAD_V>" if self.value_dim else "<HEAD_PAD>"


def launch_abi(p: Program) -> LaunchAbi:
    check_attention_params(p, "CUDA")
    plan = plan_block_mask(p)
    has_if = any(isinstance(st, IfBlock) for k in p.kernels for st in walk_stmts(k.body))
    table = None
    if has_if and plan.kind is BlockMaskKind.TABLE:
        qs, ks = p.param("q").shape, p.param("k").shape
        table = TableSpec(plan.per_b, plan.per_h, str(qs[0]), str(qs[1]), str(qs[2]), str(ks[2]),
                          p.schedule.block_m, p.schedule.block_n)
    return LaunchAbi(
        program=p.name,
        tensors=tuple(q for q in p.params if q.role is not Role.SCALAR),
        dims=tuple(d for d in p.dims() if d not in SCHEDULE_CONSTANTS),
        scalars=tuple(q.name for q in p.params if q.role is Role.SCALAR),
        table=table,
        head_pad=p.schedule.fixed_head_pad or 0,
        value_dim=VALUE_DIM in p.dims(),
    )


def source_schedule(p: Program, source: str) -> Program:
    """`p` with the BLOCK_M / BLOCK_N / warps the lowered source was generated for."""
    found = dict(re.findall(r"constexpr (?:long long|int) (BLOCK_M|BLOCK_N|KB_WARPS) = (\d+);", source))
    if not {"BLOCK_M", "BLOCK_N", "KB_WARPS"} <= set(found):
        raise KBError(f"program {p.name}: the CUDA source does not declare BLOCK_M, BLOCK_N and KB_WARPS; "
                      "is it a kb.lower.cuda / kb.lower.cuda_mma output?")
    s = dataclasses.replace(p.schedule, block_m=int(found["BLOCK_M"]), block_n=int(found["BLOCK_N"]),
                            num_warps=int(found["KB_WARPS"]))
    return dataclasses.replace(p, schedule=s)


# ------------------------------------------------------------------ tiles


@dataclass(frozen=True)
class _Tile:
    code: str  # the shared-memory pointer
    shape: tuple[str, ...]  # C++ constant expressions (ints or HEAD_PAD)
    dtype: Dtype

    @property
    def pad(self) -> int:
        """Elements appended to each row of the last dim (one 32-bit word; none for 1-D tiles)."""
        return max(1, 4 // _BYTES[self.dtype]) if len(self.shape) >= 2 else 0

    def elems(self) -> str:
        return " * ".join(self.shape)

    def alloc_elems(self) -> str:
        rows = self.shape[:-1]
        last = f"({self.shape[-1]} + {self.pad})" if self.pad else self.shape[-1]
        return " * ".join((*rows, last))

    def addr(self, coords: list[str]) -> str:
        """Flat offset of the element at `coords` (one per dim)."""
        if len(coords) == 1:
            return coords[0]
        row = coords[0]
        for c, s in zip(coords[1:-1], self.shape[1:-1]):
            row = f"({row}) * {s} + {c}"
        return f"({row}) * ({self.shape[-1]} + {self.pad}) + {coords[-1]}"

    def read(self, coords: list[str]) -> str:
        elem = f"{self.code}[{self.addr(coords)}]"
        if self.dtype in (Dtype.BF16, Dtype.F16):
            return f"kb_f({elem})"
        if DTYPE_KIND[self.dtype] is Kind.INT and self.dtype is not Dtype.I64:
            return f"((long long){elem})"
        return elem


@dataclass
class _Buffer:
    code: str
    ctype: str
    bytes_expr: list[str] = field(default_factory=list)  # candidates; the max is allocated


class CudaKernelGen(KernelGenBase[_Tile], StmtVisitor[None]):
    """Generates one `__global__` kernel (body lines plus its shared-memory layout)."""

    rejects = BACKWARD_OPS
    rejects_why = "the CUDA lowerings are forward-only; lower a backward program with kb.lower.triton"

    INDENT = "  "

    def __init__(self, p: Program, k: Kernel, abi: LaunchAbi, plan: BlockMaskPlan) -> None:
        self.scalar_params = [q for q in p.params if q.role is Role.SCALAR]
        super().__init__(p, k, plan, abi.dims, self.scalar_params, cxx_name)
        self.abi = abi
        self.buffers: dict[str, _Buffer] = {}
        self.scopes: list[set[str]] = [set()]
        self.counter = 0
        self.aux = {t.name: AuxRef(f"kb_a.{cxx_name(t.name)}", tuple(f"kb_a.{cxx_name(t.name)}_stride[{i}]" for i in range(len(t.shape))),
                                   tuple(_size_code(d) for d in t.shape), DTYPE_KIND[t.dtype])
                    for t in abi.tensors if t.role is Role.AUX}

    # -- helpers
    def ex(self, e: Expr) -> str:
        return lower_cexpr(e, self.ctx())

    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"kb_{base}{self.counter}"

    @contextmanager
    def indent(self, header: str | None = None) -> Iterator[None]:
        if header is not None:
            self.emit(header + " {")
        self.depth += 1
        self.scopes.append(set())
        try:
            yield
        finally:
            self.scopes.pop()
            self.depth -= 1
            if header is not None:
                self.emit("}")

    @contextmanager
    def elements(self, shape: tuple[str, ...]) -> Iterator[list[str]]:
        """A block-stride loop over a tile's elements, last dim fastest; yields coordinate names."""
        total = " * ".join(shape)
        with self.indent(f"for (int kb_e = threadIdx.x; kb_e < {total}; kb_e += KB_THREADS)"):
            coords = [f"kb_c{i}" for i in range(len(shape))]
            rest = "kb_e"
            for i in range(len(shape) - 1, 0, -1):
                self.emit(f"const int {coords[i]} = {rest} % {shape[i]};")
                rest = f"{rest} / {shape[i]}" if rest == "kb_e" else f"({rest}) / {shape[i]}"
            self.emit(f"const int {coords[0]} = {rest};")
            yield coords

    def sync(self) -> None:
        self.emit("__syncthreads();")

    def declared(self, code: str) -> bool:
        return any(code in s for s in self.scopes)

    def bind_scalar(self, name: str, e: Expr) -> None:
        kind = expr_kind(e, self.ctx())
        value = self.ex(e)
        code = cxx_name(name)
        if name in self.tiles:
            raise KBError(f"kernel {self.k.name}: {name!r} is a tile and cannot become a scalar")
        if self.declared(code):
            if self.names[name].kind is not kind:
                raise KBError(f"kernel {self.k.name}: scalar {name!r} changes kind to {kind.value}")
            self.emit(f"{code} = {value};")
        else:
            self.emit(f"{cxx_type(kind)} {code} = {value};")
            self.scopes[-1].add(code)
        self.names[name] = Sym(code, kind, is_nonneg(e, self.ctx()) if kind is Kind.INT else False)

    def _size(self, d: object, span: object = None) -> str:
        if span is not None:
            return str(self._const_size(span))
        if d == "D" or d == "HEAD_PAD":
            return "HEAD_PAD"
        if d == VALUE_DIM or d == "HEAD_PAD_V":
            return "HEAD_PAD_V"
        if isinstance(d, int):
            return str(next_pow2(d))
        n = self._schedule_int(d)
        if n is not None:
            return str(next_pow2(n))
        raise KBError(f"kernel {self.k.name}: the CUDA lowering cannot load `:` over the runtime dim {d!r} "
                      "(its padded size must be known at compile time); use a span `start:+BLOCK` instead")

    def _schedule_int(self, d: object) -> int | None:
        """The value of BLOCK_M, BLOCK_N or NUM_SPLITS; None for anything else."""
        s = self.p.schedule
        return s.tile_constants().get(d) if isinstance(d, str) else None

    def _const_size(self, d: object) -> int | str:
        if isinstance(d, int):
            return d
        n = self._schedule_int(d)
        if n is not None:
            return n
        if d in ("HEAD_PAD", "HEAD_PAD_V"):
            return str(d)
        raise KBError(f"kernel {self.k.name}: tile size {d!r} must be a schedule constant or an int")

    def new_tile(self, ir_name: str, shape: tuple[str, ...], dtype: Dtype, internal: bool = False) -> _Tile:
        base = ir_name if internal else cxx_name(ir_name)
        ctype = CTYPE[dtype]
        code = base
        buf = self.buffers.get(code)
        if buf is not None and buf.ctype != ctype:
            code = f"{base}_{dtype.value}"
            buf = self.buffers.get(code)
        if buf is None:
            buf = self.buffers[code] = _Buffer(code, ctype)
        tile = _Tile(code, shape, dtype)
        bytes_expr = f"{tile.alloc_elems()} * {_BYTES[dtype]}"
        if bytes_expr not in buf.bytes_expr:
            buf.bytes_expr.append(bytes_expr)
        if not internal:
            self.tiles[ir_name] = tile
            self.names[ir_name] = Sym(code, DTYPE_KIND[dtype])
        return tile

    def tile_names(self, coords: list[str]) -> dict[str, Sym]:
        """Names for an element loop: every tile reads its element at `coords`."""
        names = dict(self.names)
        for n, t in self.tiles.items():
            if len(t.shape) == len(coords):
                names[n] = Sym(t.read(coords), DTYPE_KIND[t.dtype])
        return names

    # -- addressing
    def address(self, tensor: str, index: tuple, coords: list[str]) -> tuple[str, str | None, tuple[str, ...]]:
        """(element offset, in-range test or None, tile shape) of `tensor[index]` at tile `coords`."""
        prm = self.tensor_param(tensor, index)
        terms, guards, shape = [], [], []
        pos = 0
        for i, (d, item) in enumerate(zip(prm.shape, index)):
            stride = f"kb_a.{cxx_name(tensor)}_stride[{i}]"
            if isinstance(item, Expr):
                terms.append(f"({self.ex(item)}) * {stride}")
                continue
            c = coords[pos] if coords else "0"
            pos += 1
            if isinstance(item, Span):
                size = self._size(d, item.size)
                g = f"({self.ex(item.start)} + {c})"
                if not is_nonneg(item.start, self.ctx()):
                    guards.append(f"{g} >= 0LL")
            else:
                size = self._size(d)
                g = f"(long long){c}"
            shape.append(size)
            terms.append(f"{g} * {stride}")
            if not (isinstance(d, int) and str(d) == size):
                guards.append(f"{g} < {_size_code(d)}")
        return " + ".join(terms), " && ".join(guards) or None, tuple(shape)

    def shape_of(self, tensor: str, index: tuple) -> tuple[str, ...]:
        n = sum(not isinstance(i, Expr) for i in index)
        return self.address(tensor, index, [f"kb_c{i}" for i in range(n)])[2]

    # -- statements
    def block(self, body: tuple[Stmt, ...]) -> None:
        for st in body:
            self.visit(st)

    def s_load(self, st: Load) -> None:
        dtype = self.p.param(st.tensor).dtype
        shape = self.shape_of(st.tensor, st.index)
        if not shape:
            raise KBError(f"load {st.out}: loads of single elements are not tiles; use a span or `:`")
        out = self.new_tile(st.out, shape, dtype)
        other = f"kb_cvt<{CTYPE[dtype]}>({float_literal(st.other)})"
        self.emit(f"// load {st.out} = {st.tensor}[...]: [{', '.join(shape)}] {dtype.value}")
        with self.elements(shape) as c:
            off, ok, _ = self.address(st.tensor, st.index, c)
            value = f"kb_a.{cxx_name(st.tensor)}[{off}]"
            self.emit(f"{out.code}[{out.addr(c)}] = " + (f"({ok}) ? {value} : {other};" if ok else f"{value};"))
        self.sync()

    def s_store(self, st: Store) -> None:
        prm = self.p.param(st.tensor)
        tile = self.tile(st.value)
        shape = self.shape_of(st.tensor, st.index)
        if len(shape) != len(tile.shape):
            raise KBError(f"store {st.tensor}: tile {st.value} has rank {len(tile.shape)}, the index spans {len(shape)} dims")
        self.emit(f"// store {st.tensor}[...] = {st.value}")
        with self.elements(tile.shape) as c:
            off, ok, _ = self.address(st.tensor, st.index, c)
            x = tile.read(c)
            value = f"kb_cvt<{CTYPE[prm.dtype]}>(kb_f({x}))" if DTYPE_KIND[prm.dtype] is Kind.FLOAT \
                else f"({CTYPE[prm.dtype]})({x})"
            assign = f"kb_a.{cxx_name(st.tensor)}[{off}] = {value};"
            self.emit(f"if ({ok}) {assign}" if ok else assign)
        self.sync()  # a later statement (say, the next loop iteration) may overwrite the stored tile

    def s_init(self, st: Init) -> None:
        shape = tuple(str(self._const_size(d)) for d in st.shape)
        out = self.new_tile(st.out, shape, st.dtype)
        if isinstance(st.fill, Expr):  # check_attention_params refuses these programs before any statement
            raise KBError(f"init {st.out}: the CUDA lowering takes constant fills only")
        fill = float_literal(st.fill) if DTYPE_KIND[st.dtype] is Kind.FLOAT else str(int(st.fill))
        with self.elements(shape) as c:
            self.emit(f"{out.code}[{out.addr(c)}] = kb_cvt<{CTYPE[st.dtype]}>({fill});"
                      if st.dtype in (Dtype.BF16, Dtype.F16) else f"{out.code}[{out.addr(c)}] = {fill};")
        self.sync()

    def s_dot(self, st: Dot) -> None:
        a, b = self.tile(st.a), self.tile(st.b)
        if len(a.shape) != 2 or len(b.shape) != 2:
            raise KBError(f"dot {st.out}: operands must be 2-D tiles")
        k_a = a.shape[1]
        k_b, n = (b.shape[1], b.shape[0]) if st.trans_b else (b.shape[0], b.shape[1])
        if k_a != k_b:
            raise KBError(f"dot {st.out}: inner sizes differ ({k_a} vs {k_b})")
        if st.out in (st.a, st.b):
            raise KBError(f"dot {st.out}: the output may not overwrite an operand")
        out = self.new_tile(st.out, (a.shape[0], n), Dtype.F32)
        self.emit(f"// dot {st.out} = {st.a} @ {'trans(' + st.b + ')' if st.trans_b else st.b}: fp32 accumulation from shared memory")
        self.matmul(out, lambda i, k: a.read([i, k]),
                    (lambda k, j: b.read([j, k])) if st.trans_b else (lambda k, j: b.read([k, j])), k_a,
                    lambda i, j, t: f"{out.code}[{out.addr([i, j])}] = {t};")
        self.sync()

    def matmul(self, out: _Tile, a_at, b_at, k: str, store) -> None:
        """out[i, j] = store(i, j, sum_k a_at(i, k) * b_at(k, j)), fp32, operands in shared memory.

        Register micro-tiles when the shape allows (checked at compile time with `if constexpr`,
        HEAD_PAD being a template parameter): each thread owns KB_NR rows x KB_NC columns, strided
        so that a warp's column reads are consecutive, i.e. KB_NR + KB_NC shared loads per
        KB_NR * KB_NC FMAs. Otherwise one output element per loop step.
        """
        rows, cols = out.shape
        self.emit("{")
        with self.indent():
            self.emit(f"constexpr int KB_NC = ({cols}) >= 64 ? 4 : ({cols}) >= 32 ? 2 : 1;")
            self.emit(f"constexpr int KB_TC = ({cols}) / KB_NC;  // threads along a row")
            self.emit("constexpr int KB_TR = KB_THREADS / KB_TC;  // row groups")
            self.emit(f"constexpr int KB_NR = KB_TR > 0 ? ({rows}) / KB_TR : 0;")
            cond = f"KB_THREADS % KB_TC == 0 && KB_TR <= ({rows}) && ({rows}) % KB_TR == 0 && KB_NR <= 16"
            with self.indent(f"if constexpr ({cond})"):
                self.emit("const int kb_j0 = threadIdx.x % KB_TC, kb_i0 = threadIdx.x / KB_TC;")
                self.emit("float kb_t[KB_NR][KB_NC];")
                self.emit("#pragma unroll")
                self.emit("for (int r = 0; r < KB_NR; ++r)")
                self.emit("  #pragma unroll")
                self.emit("  for (int c = 0; c < KB_NC; ++c) kb_t[r][c] = 0.0f;")
                self.emit("#pragma unroll 4")
                with self.indent(f"for (int kb_k = 0; kb_k < {k}; ++kb_k)"):
                    self.emit("float kb_bv[KB_NC];")
                    self.emit("#pragma unroll")
                    self.emit(f"for (int c = 0; c < KB_NC; ++c) kb_bv[c] = {b_at('kb_k', 'kb_j0 + c * KB_TC')};")
                    self.emit("#pragma unroll")
                    with self.indent("for (int r = 0; r < KB_NR; ++r)"):
                        self.emit(f"const float kb_av = {a_at('kb_i0 + r * KB_TR', 'kb_k')};")
                        self.emit("#pragma unroll")
                        self.emit("for (int c = 0; c < KB_NC; ++c) kb_t[r][c] = fmaf(kb_av, kb_bv[c], kb_t[r][c]);")
                self.emit("#pragma unroll")
                with self.indent("for (int r = 0; r < KB_NR; ++r)"):
                    self.emit("#pragma unroll")
                    with self.indent("for (int c = 0; c < KB_NC; ++c)"):
                        self.emit("const int kb_i = kb_i0 + r * KB_TR, kb_j = kb_j0 + c * KB_TC;")
                        self.emit(store("kb_i", "kb_j", "kb_t[r][c]"))
            with self.indent("else"):
                with self.elements(out.shape) as c:
                    self.emit("float kb_s = 0.0f;")
                    self.emit("#pragma unroll 8")
                    self.emit(f"for (int kb_k = 0; kb_k < {k}; ++kb_k) kb_s = fmaf({a_at(c[0], 'kb_k')}, {b_at('kb_k', c[1])}, kb_s);")
                    self.emit(store(c[0], c[1], "kb_s"))
        self.emit("}")

    def s_elementwise(self, st: Elementwise) -> None:
        used = [self.tiles[n] for n in sorted(free_vars(st.value)) if n in self.tiles]
        if not used:
            self.bind_scalar(st.out, st.value)
            return
        shape = used[0].shape
        if any(t.shape != shape for t in used):
            raise KBError(f"elementwise {st.out}: tiles of different shapes {[t.shape for t in used]}")
        coords = [f"kb_c{i}" for i in range(len(shape))]
        ctx = self.ctx(self.tile_names(coords))
        kind, value = expr_kind(st.value, ctx), lower_cexpr(st.value, ctx)  # read before `out` is rebound
        dtype = Dtype.F32 if kind is Kind.FLOAT else Dtype.I64 if kind is Kind.INT else Dtype.BOOL
        out = self.new_tile(st.out, shape, dtype)
        self.emit(f"// elementwise {st.out} = {st.value}")
        with self.elements(shape) as c:
            self.emit(f"{out.code}[{out.addr(c)}] = {value};")
        self.sync()

    def s_reduce(self, st: Reduce) -> None:
        src = self.tile(st.src)
        self.check_reduce(st)
        if len(src.shape) != 2 or DTYPE_KIND[src.dtype] is not Kind.FLOAT:
            raise KBError(f"reduce {st.out}: the CUDA lowering reduces 2-D float tiles only")
        init, op = ("-INFINITY", "fmaxf") if st.kind == "max" else ("0.0f", "kb_add")
        rows, cols = (src.shape[0], src.shape[1]) if st.axis == 1 else (src.shape[1], src.shape[0])
        out = self.new_tile(st.out, (rows,), Dtype.F32)
        if st.axis == 1:
            self.emit(f"// reduce {st.out} = {st.kind}({st.src}, 1): one warp per row")
            with self.indent(f"for (int kb_r = kb_warp; kb_r < {rows}; kb_r += KB_WARPS)"):
                self.emit(f"float kb_v = {init};")
                self.emit(f"for (int kb_c = kb_lane; kb_c < {cols}; kb_c += 32) kb_v = {op}(kb_v, {src.read(['kb_r', 'kb_c'])});")
                self.emit(f"kb_v = kb_warp_{st.kind}(kb_v);")
                self.emit(f"if (kb_lane == 0) {out.code}[kb_r] = kb_v;")
        else:
            with self.indent(f"for (int kb_r = threadIdx.x; kb_r < {rows}; kb_r += KB_THREADS)"):
                self.emit(f"float kb_v = {init};")
                self.emit(f"for (int kb_c = 0; kb_c < {cols}; ++kb_c) kb_v = {op}(kb_v, {src.read(['kb_c', 'kb_r'])});")
                self.emit(f"{out.code}[kb_r] = kb_v;")
        self.sync()

    def variant_names(self, st: ScoreMod | Mask, tile: _Tile, c: list[str]) -> dict[str, Sym]:
        if st.at.head_rows:
            raise KBError(f"{st.op.value} {st.tile}: tile rows as query heads (a grouped decode) have no CUDA lowering")
        names = {d: self.names[d] for d in self.abi.dims}
        names.update({s.name: self.names[s.name] for s in self.scalar_params})
        names["b"] = Sym(f"({self.ex(st.at.b)})", Kind.INT, is_nonneg(st.at.b, self.ctx()))
        names["h"] = Sym(f"({self.ex(st.at.h)})", Kind.INT, is_nonneg(st.at.h, self.ctx()))
        self.emit(f"[[maybe_unused]] const long long kb_qi = {self.ex(st.at.q_start)} + {c[0]};")
        self.emit(f"[[maybe_unused]] const long long kb_ki = {self.ex(st.at.kv_start)} + {c[1]};")
        names["q_idx"] = Sym("kb_qi", Kind.INT, is_nonneg(st.at.q_start, self.ctx()))
        names["kv_idx"] = Sym("kb_ki", Kind.INT, is_nonneg(st.at.kv_start, self.ctx()))
        return names

    def _score_tile(self, st: ScoreMod | Mask) -> _Tile:
        tile = self.tile(st.tile)
        if len(tile.shape) != 2 or tile.dtype is not Dtype.F32:
            raise KBError(f"{st.op.value} {st.tile}: expects a 2-D fp32 score tile, got {tile.shape} {tile.dtype.value}")
        return tile

    def s_scoremod(self, st: ScoreMod) -> None:
        score_mod = self.score_mod_body(st)
        tile = self._score_tile(st)
        self.emit(f"// score_mod {st.tile}: {score_mod}")
        with self.elements(tile.shape) as c:
            names = self.variant_names(st, tile, c)
            self.emit(f"const float kb_sc = {tile.code}[{tile.addr(c)}];")
            names["score"] = Sym("kb_sc", Kind.FLOAT)
            ctx = self.ctx(names)
            value = lower_cexpr(score_mod, ctx)
            if expr_kind(score_mod, ctx) is not Kind.FLOAT:
                value = f"((float)({value}))"
            self.emit(f"{tile.code}[{tile.addr(c)}] = {value};")
        self.sync()

    def s_mask(self, st: Mask) -> None:
        tile = self._score_tile(st)
        self.emit(f"// mask {st.tile}: kv_idx < {self.n_dim}" + (f" & ({self.p.mask_mod.body})" if st.use_mask_mod and self.p.mask_mod else ""))
        with self.elements(tile.shape) as c:
            names = self.variant_names(st, tile, c)
            keep = f"(kb_ki < {cxx_name(self.n_dim)})"
            if st.use_mask_mod:
                keep += f" && {lower_cexpr(self.mask_mod_body(st), self.ctx(names))}"
            self.emit(f"if (!({keep})) {tile.code}[{tile.addr(c)}] = -INFINITY;")
        self.sync()

    def s_onlinesoftmax(self, st: OnlineSoftmax) -> None:
        m, l, acc, s, v = (self.tile(n) for n in (st.m, st.l, st.acc, st.scores, st.values))
        rows, cols = s.shape
        if m.shape != (rows,) or l.shape != (rows,) or acc.shape[0] != rows or v.shape[0] != cols \
                or acc.shape[1] != v.shape[1] or any(t.dtype is not Dtype.F32 for t in (m, l, acc, s)):
            raise KBError(f"online_softmax ({st.m}, {st.l}, {st.acc}) += {st.scores} @ {st.values}: "
                          "expects fp32 m, l [R], acc [R, D], scores [R, C] and values [C, D]")
        p = self.new_tile(f"kb_p_{acc.code}", (rows, cols), Dtype.F32, internal=True)
        alpha = self.new_tile(f"kb_alpha_{acc.code}", (rows,), Dtype.F32, internal=True)
        self.emit(f"// online_softmax ({st.m}, {st.l}, {st.acc}) += {st.scores} @ {st.values}: row statistics, one warp per row")
        with self.indent(f"for (int kb_r = kb_warp; kb_r < {rows}; kb_r += KB_WARPS)"):
            self.emit(f"const float kb_m_old = {m.code}[kb_r];")
            self.emit("float kb_mx = -INFINITY;")
            self.emit(f"for (int kb_c = kb_lane; kb_c < {cols}; kb_c += 32) kb_mx = fmaxf(kb_mx, {s.read(['kb_r', 'kb_c'])});")
            self.emit("const float kb_m_new = fmaxf(kb_m_old, kb_warp_max(kb_mx));")
            self.emit("// rows with no unmasked score yet keep m = -inf; subtract 0 there so exp2 sees -inf, never NaN")
            self.emit(f"const float kb_m_log2 = (kb_m_new == -INFINITY ? 0.0f : kb_m_new) * {_LOG2E};")
            self.emit("float kb_sum = 0.0f;")
            with self.indent(f"for (int kb_c = kb_lane; kb_c < {cols}; kb_c += 32)"):
                self.emit(f"const float kb_pv = exp2f(fmaf({s.read(['kb_r', 'kb_c'])}, {_LOG2E}, -kb_m_log2));")
                self.emit(f"{p.code}[{p.addr(['kb_r', 'kb_c'])}] = kb_pv;")
                self.emit("kb_sum += kb_pv;")
            self.emit("kb_sum = kb_warp_sum(kb_sum);")
            self.emit("__syncwarp();  // every lane has read m before lane 0 overwrites it")
            with self.indent("if (kb_lane == 0)"):
                self.emit(f"const float kb_al = exp2f(fmaf(kb_m_old, {_LOG2E}, -kb_m_log2));")
                self.emit(f"{alpha.code}[kb_r] = kb_al;")
                self.emit(f"{l.code}[kb_r] = {l.code}[kb_r] * kb_al + kb_sum;")
                self.emit(f"{m.code}[kb_r] = kb_m_new;")
        self.sync()
        self.emit(f"// {st.acc} = {st.acc} * alpha + p @ {st.values}")
        self.matmul(acc, lambda i, j: f"{p.code}[{p.addr([i, j])}]", lambda j, d: v.read([j, d]), cols,
                    lambda i, d, t: f"{acc.code}[{acc.addr([i, d])}] = fmaf({acc.code}[{acc.addr([i, d])}], "
                                    f"{alpha.code}[{i}], {t});")
        self.sync()

    def s_finalize(self, st: Finalize) -> None:
        m, l, acc = (self.tile(n) for n in (st.m, st.l, st.acc))
        o = self.new_tile(st.o, acc.shape, Dtype.F32)
        lse = self.new_tile(st.lse, l.shape, Dtype.F32)
        self.emit(f"// finalize {st.o}, {st.lse}: o = acc / l (0 where l == 0), lse = m + log(l) (-inf where l == 0)")
        with self.elements(acc.shape) as c:
            self.emit(f"const float kb_l = {l.code}[{c[0]}];")
            self.emit(f"{o.code}[{o.addr(c)}] = {acc.code}[{acc.addr(c)}] / (kb_l == 0.0f ? 1.0f : kb_l);")
        with self.indent(f"for (int kb_r = threadIdx.x; kb_r < {l.shape[0]}; kb_r += KB_THREADS)"):
            self.emit(f"const float kb_l = {l.code}[kb_r];")
            self.emit(f"{lse.code}[kb_r] = kb_l == 0.0f ? -INFINITY : {m.code}[kb_r] + logf(kb_l);")
        self.sync()

    def s_combine(self, st: Combine) -> None:
        po, pl = self.tile(st.o_parts), self.tile(st.lse_parts)
        if len(pl.shape) != 2 or len(po.shape) != 3 or po.shape[:2] != pl.shape:
            raise KBError(f"combine {st.o}: expects lse_parts [S, R] and o_parts [S, R, D]")
        splits, rows = pl.shape
        o = self.new_tile(st.o, po.shape[1:], Dtype.F32)
        lse = self.new_tile(st.lse, (rows,), Dtype.F32)
        w = self.new_tile(f"kb_w_{o.code}", (splits, rows), Dtype.F32, internal=True)
        ws = self.new_tile(f"kb_ws_{o.code}", (rows,), Dtype.F32, internal=True)
        self.emit(f"// combine {st.o}, {st.lse}: lse = logsumexp over splits; splits without keys (lse = -inf) weigh 0")
        with self.indent(f"for (int kb_r = threadIdx.x; kb_r < {rows}; kb_r += KB_THREADS)"):
            self.emit("float kb_mx = -INFINITY;")
            self.emit(f"for (int kb_s = 0; kb_s < {splits}; ++kb_s) kb_mx = fmaxf(kb_mx, {pl.read(['kb_s', 'kb_r'])});")
            self.emit("const float kb_m0 = kb_mx == -INFINITY ? 0.0f : kb_mx;")
            self.emit("float kb_sum = 0.0f;")
            with self.indent(f"for (int kb_s = 0; kb_s < {splits}; ++kb_s)"):
                self.emit(f"const float kb_wv = expf({pl.read(['kb_s', 'kb_r'])} - kb_m0);")
                self.emit(f"{w.code}[{w.addr(['kb_s', 'kb_r'])}] = kb_wv;")
                self.emit("kb_sum += kb_wv;")
            self.emit(f"{lse.code}[kb_r] = kb_sum == 0.0f ? -INFINITY : kb_m0 + logf(kb_sum);")
            self.emit(f"{ws.code}[kb_r] = kb_sum == 0.0f ? 1.0f : kb_sum;")
        self.sync()
        with self.elements(o.shape) as c:
            self.emit("float kb_t = 0.0f;")
            self.emit(f"for (int kb_s = 0; kb_s < {splits}; ++kb_s) "
                      f"kb_t = fmaf({w.code}[{w.addr(['kb_s', c[0]])}], {po.read(['kb_s', c[0], c[1]])}, kb_t);")
            self.emit(f"{o.code}[{o.addr(c)}] = kb_t / {ws.code}[{c[0]}];")
        self.sync()

    def s_for(self, st: For) -> None:
        lo, hi = self.ex(st.lo), self.ex(st.hi)
        step = str(self._const_size(st.step))
        var = cxx_name(st.var)
        before = dict(self.tiles)
        self.check_order(st)
        self.emit(f"// for {st.var} in range({st.lo}, {st.hi}, {st.step}) {st.order}")
        if st.order == "forward":
            self.emit("#pragma unroll 1")
            header = f"for (long long {var} = {lo}; {var} < {hi}; {var} += {step})"
            with self.indent(header):
                self.scopes[-1].add(var)
                self.names[st.var] = self.loop_sym(st, var)
                self.block(st.body)
        else:
            it, n = self.fresh("it"), self.fresh("n_iter")
            self.emit(f"const long long {n} = kb_cdiv({hi} - {lo}, {step});")
            self.emit("#pragma unroll 1")
            with self.indent(f"for (long long {it} = 0; {it} < {n}; ++{it})"):
                self.emit(f"const long long {var} = {lo} + ({n} - 1 - {it}) * {step};")
                self.scopes[-1].add(var)
                self.names[st.var] = self.loop_sym(st, var)
                self.block(st.body)
        for name, t in before.items():
            if self.tiles.get(name) != t:
                raise KBError(f"for {st.var}: tile {name!r} is redefined in the loop with another shape or dtype; "
                              "the CUDA lowering keeps loop-carried tiles in one buffer")

    def s_ifblock(self, st: IfBlock) -> None:
        cond = self.block_condition(st)
        with self.indent(f"if ({cond})"):
            self.block(st.then)
        if st.orelse:
            with self.indent("else"):
                self.block(st.orelse)

    def block_condition(self, st: IfBlock) -> str:
        code = CLASS_CODE[st.cls]
        op = "!=" if st.negate else "=="
        if self.plan.kind is BlockMaskKind.TABLE:
            cls = self.fresh("bclass")
            qs, ks = self.ex(st.at.q_start), self.ex(st.at.kv_start)
            bi = self.ex(st.at.b) if self.plan.per_b else "0LL"
            hi = self.ex(st.at.h) if self.plan.per_h else "0LL"
            self.emit("// block class from the table (0 empty, 1 partial, 2 full); an unaligned tile is partial")
            self.emit(f"const int {cls} = kb_table_class(kb_a, {bi}, {hi}, {qs}, {ks});")
            return f"{cls} {op} {code}"
        test = block_class_test(self.plan, st, self.m_dim, self.n_dim)
        name = self.fresh(f"is_{st.cls.value}")
        self.emit(f"// block class in closed form ({self.plan.kind.value}) of the tile at ({st.at.q_start}, {st.at.kv_start})")
        self.emit(f"const bool {name} = {self.ex(test)};")
        return f"!{name}" if st.negate else name

    # -- whole kernel
    def decode_grid(self) -> None:
        """Declare the grid axes from the flattened `blockIdx.x` (the last axis varies fastest)."""
        axes = self.k.grid
        self.emit(f"// grid ({', '.join(f'{a.name}: {a.extent}' for a in axes)}), flattened; the last axis varies fastest")
        self.emit("long long kb_pid = blockIdx.x;")
        for a in reversed(axes[1:]):
            ext = self.ex(a.extent)
            self.emit(f"const long long {cxx_name(a.name)} = kb_pid % ({ext});")
            self.emit(f"kb_pid = kb_pid / ({ext});")
        self.emit(f"const long long {cxx_name(axes[0].name)} = kb_pid;")
        for a in axes:
            self.names[a.name] = Sym(cxx_name(a.name), Kind.INT, True)
            self.scopes[-1].add(cxx_name(a.name))

    def generate(self) -> list[str]:
        self.decode_grid()
        self.block(self.k.body)
        return self.lines

    def smem_struct(self) -> list[str]:
        name = f"kb_{self.k.name}_smem"
        out = [self.abi.template, f"struct {name} {{"]
        prev = None
        for buf in self.buffers.values():
            size = buf.bytes_expr[0] if len(buf.bytes_expr) == 1 else \
                "kb_cmax(" + ", ".join(buf.bytes_expr) + ")" if len(buf.bytes_expr) == 2 else \
                _nested_max(buf.bytes_expr)
            start = "0" if prev is None else f"kb_align16({prev[0]} + {prev[1]})"
            out.append(f"  static constexpr int {buf.code} = {start};  // {buf.ctype}")
            prev = (buf.code, size)
        total = "0" if prev is None else f"kb_align16({prev[0]} + {prev[1]})"
        out.append(f"  static constexpr int bytes = {total};")
        out.append("};")
        return out

    def pointer_decls(self) -> list[str]:
        layout = f"kb_{self.k.name}_smem{self.abi.targs}"
        return [f"  {b.ctype}* {b.code} = reinterpret_cast<{b.ctype}*>(kb_smem + {layout}::{b.code});"
                for b in self.buffers.values()]



def _nested_max(xs: list[str]) -> str:
    out = xs[0]
    for x in xs[1:]:
        out = f"kb_cmax({out}, {x})"
    return out


# ------------------------------------------------------------------ source


PREAMBLE = r"""
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
"""

KERNEL_HELPERS = r"""
constexpr int kb_align16(int x) { return (x + 15) / 16 * 16; }
constexpr int kb_cmax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ float kb_add(float a, float b) { return a + b; }
__device__ __forceinline__ float kb_warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float kb_warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
""".strip("\n")


def args_struct(abi: LaunchAbi) -> list[str]:
    out = ["// every kernel receives the same arguments by value (pointers, strides, dims, scalars)", "struct KbArgs {"]
    for t in abi.tensors:
        const = "const " if t.role in (Role.IN, Role.AUX) else ""
        out.append(f"  {const}{CTYPE[t.dtype]}* {cxx_name(t.name)};  // [{', '.join(map(str, t.shape))}] {t.dtype.value} {t.role.value}")
        out.append(f"  long long {cxx_name(t.name)}_stride[{max(1, len(t.shape))}];")
    for d in abi.dims:
        out.append(f"  long long {cxx_name(d)};")
    for s in abi.scalars:
        out.append(f"  float {cxx_name(s)};")
    if abi.table:
        out.append("  const signed char* bc;  // block classes [nb, nh, nm, nn], contiguous")
        out.append("  long long bc_size[4];")
    out.append("};")
    return out


def arg_locals(abi: LaunchAbi, scalars: list[Param], indent: str = "  ") -> list[str]:
    out = [f"{indent}[[maybe_unused]] const long long {cxx_name(d)} = kb_a.{cxx_name(d)};" for d in abi.dims]
    out += [f"{indent}[[maybe_unused]] const float {cxx_name(s.name)} = kb_a.{cxx_name(s.name)};" for s in scalars]
    return out


def table_helpers(p: Program, abi: LaunchAbi, threads: int) -> list[str]:
    assert abi.table is not None and p.mask_mod is not None
    t = abi.table
    scalars = [q for q in p.params if q.role is Role.SCALAR]
    names = visible_names(abi.dims, scalars, cxx_name)
    names.update({n: Sym(n, Kind.INT, True) for n in ("b", "h", "q_idx", "kv_idx")})
    aux = {q.name: AuxRef(f"kb_a.{cxx_name(q.name)}", tuple(f"kb_a.{cxx_name(q.name)}_stride[{i}]" for i in range(len(q.shape))),
                          tuple(_size_code(d) for d in q.shape), DTYPE_KIND[q.dtype]) for q in abi.tensors if q.role is Role.AUX}
    ctx = ExprContext(ExprTarget.DEVICE, names, aux)
    attend = lower_cexpr(p.mask_mod.body, ctx)
    return [
        "// block classes of mask_mod, one CTA per (b|0, h|0, query block, key block): 0 empty, 1 partial, 2 full",
        f"__global__ void __launch_bounds__({threads}) kb_block_class_kernel(const KbArgs kb_a, signed char* kb_out) {{",
        *arg_locals(abi, scalars),
        "  long long kb_pid = blockIdx.x;",
        "  const long long kb_nb = kb_pid % kb_a.bc_size[3]; kb_pid /= kb_a.bc_size[3];",
        "  const long long kb_mb = kb_pid % kb_a.bc_size[2]; kb_pid /= kb_a.bc_size[2];",
        "  [[maybe_unused]] const long long h = kb_pid % kb_a.bc_size[1];",
        "  [[maybe_unused]] const long long b = kb_pid / kb_a.bc_size[1];",
        "  const long long kb_q0 = kb_mb * BLOCK_M, kb_k0 = kb_nb * BLOCK_N;",
        "  bool kb_any = false, kb_all = true;",
        "  for (int kb_e = threadIdx.x; kb_e < BLOCK_M * BLOCK_N; kb_e += KB_THREADS) {",
        "    const long long q_idx = kb_q0 + kb_e / BLOCK_N, kv_idx = kb_k0 + kb_e % BLOCK_N;",
        f"    if (q_idx < {cxx_name(t.m_dim)} && kv_idx < {cxx_name(t.n_dim)}) {{",
        f"      const bool kb_att = {attend};",
        "      kb_any = kb_any || kb_att;",
        "      kb_all = kb_all && kb_att;",
        "    }",
        "  }",
        "  kb_any = __syncthreads_or(kb_any);",
        "  kb_all = __syncthreads_and(kb_all);",
        "  if (threadIdx.x == 0) {",
        f"    const bool kb_ragged = kb_k0 + BLOCK_N > {cxx_name(t.n_dim)};",
        f"    kb_out[blockIdx.x] = !kb_any ? {EMPTY} : (kb_all && !kb_ragged) ? {FULL} : {PARTIAL};",
        "  }",
        "}",
        "",
        "// the class of the tile at (q_start, kv_start); out-of-table tiles read empty (the IR's load rule)",
        "__device__ __forceinline__ int kb_table_class(const KbArgs& kb_a, long long b, long long h, long long q0, long long k0) {",
        f"  if (kb_floormod(q0, BLOCK_M) != 0 || kb_floormod(k0, BLOCK_N) != 0) return {PARTIAL};",
        "  const long long mb = kb_floordiv(q0, BLOCK_M), nb = kb_floordiv(k0, BLOCK_N);",
        "  const long long* n = kb_a.bc_size;",
        "  if (b < 0 || b >= n[0] || h < 0 || h >= n[1] || mb < 0 || mb >= n[2] || nb < 0 || nb >= n[3]) return 0;",
        "  return kb_a.bc[((b * n[1] + h) * n[2] + mb) * n[3] + nb];",
        "}",
    ]


def lower_program(p: Program) -> str:
    """The CUDA C++ source running `p`: kernels, shared-memory layouts and the `kb_launch` entry."""
    abi = launch_abi(p)
    plan = plan_block_mask(p)
    s = p.schedule
    threads = s.num_warps * 32
    gens = [(k, CudaKernelGen(p, k, abi, plan)) for k in p.kernels]
    bodies = [(k, g, g.generate()) for k, g in gens]
    scalars = [q for q in p.params if q.role is Role.SCALAR]
    out = [f"// CUDA kernels for IR program `{p.name}`: generated by kb.lower.cuda, do not edit.",
           f'// Host entry: extern "C" int {LAUNCH_SYMBOL}(ptrs, strides, dims, scalars, stream); see kb/lower/cuda.py.',
           PREAMBLE.strip("\n"), "", EXPR_HELPERS, KERNEL_HELPERS, "",
           *schedule_constants(s), f"constexpr int {_err_name()} = {KB_ERR_HEAD_DIM};", "",
           *args_struct(abi), ""]
    if abi.table:
        out += [*table_helpers(p, abi, threads), ""]
    for k, g, lines in bodies:
        out += g.smem_struct()
        out += ["", abi.template,
                f"__global__ void __launch_bounds__({threads}) {kernel_symbol(k)}(const KbArgs kb_a) {{",
                "  extern __shared__ __align__(16) unsigned char kb_smem[];",
                "  [[maybe_unused]] const int kb_warp = threadIdx.x / 32, kb_lane = threadIdx.x % 32;",
                *arg_locals(abi, scalars), *g.pointer_decls(), *lines, "}", ""]
    out += host_entry(p, abi, [k for k, _ in gens], scalars)
    return "\n".join(out).rstrip() + "\n"


def schedule_constants(s: Schedule, threads: int | None = None) -> list[str]:
    """The C++ constants every generated source declares: threads and warps per CTA, the IR's schedule constants
    (its expressions name them; `CudaKernel.from_source` reads BLOCK_M/BLOCK_N/KB_WARPS back)."""
    return [f"constexpr int KB_THREADS = {threads or s.num_warps * 32};",
            f"constexpr int KB_WARPS = {s.num_warps};",
            f"[[maybe_unused]] constexpr long long BLOCK_M = {s.block_m};",
            f"[[maybe_unused]] constexpr long long BLOCK_N = {s.block_n};",
            f"[[maybe_unused]] constexpr long long NUM_SPLITS = {s.num_splits};"]


def _err_name() -> str:
    return "KB_ERR_HEAD_DIM"


def host_entry(p: Program, abi: LaunchAbi, kernels: list[Kernel], scalars: list[Param], *,
          pre_launch: list[str] | None = None, errors: Mapping[int, str] | None = None) -> list[str]:
    """The runner per HEAD_PAD, `kb_launch` and `kb_error_string`; `pre_launch` lines check the filled `kb_a`
    (returning an error code), `errors` names those codes."""
    names = visible_names(abi.dims, scalars, cxx_name)
    hctx = ExprContext(ExprTarget.HOST, names)
    L = [f"constexpr int KB_ERR_SMEM = {KB_ERR_SMEM};",
         "static int kb_smem_per_block() {  // the dynamic shared memory one block may opt in to on this device",
         "  int kb_dev = 0, kb_bytes = 0;",
         "  if (cudaGetDevice(&kb_dev) != cudaSuccess ||",
         "      cudaDeviceGetAttribute(&kb_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, kb_dev) != cudaSuccess)",
         "    return 1 << 30;  // unknown: the launch itself reports",
         "  return kb_bytes;",
         "}", "",
         abi.template, "static int kb_run(const KbArgs& kb_a, cudaStream_t kb_stream) {",
         *arg_locals(abi, scalars), "  cudaError_t kb_err = cudaSuccess;"]
    if abi.table:
        L += ["  {  // block classes first: the kernels read them",
              "    const long long kb_cells = kb_a.bc_size[0] * kb_a.bc_size[1] * kb_a.bc_size[2] * kb_a.bc_size[3];",
              "    if (kb_cells > 0) kb_block_class_kernel<<<(unsigned)kb_cells, KB_THREADS, 0, kb_stream>>>(kb_a, const_cast<signed char*>(kb_a.bc));",
              "    if ((kb_err = cudaGetLastError()) != cudaSuccess) return (int)kb_err;",
              "  }"]
    for k in kernels:
        grid = " * ".join(f"({lower_cexpr(a.extent, hctx)})" for a in k.grid)
        sym = f"{kernel_symbol(k)}{abi.targs}"
        L += [f"  {{  // kernel {k.name}",
              f"    const long long kb_grid = {grid};",
              f"    constexpr int kb_smem = kb_{k.name}_smem{abi.targs}::bytes;",
              f"    if ((kb_err = cudaFuncSetAttribute({sym}, cudaFuncAttributeMaxDynamicSharedMemorySize, kb_smem)) != cudaSuccess)",
              "      return kb_smem > kb_smem_per_block() ? KB_ERR_SMEM : (int)kb_err;  // the device query only on failure",
              f"    if (kb_grid > 0) {sym}<<<(unsigned)kb_grid, KB_THREADS, kb_smem, kb_stream>>>(kb_a);",
              "    if ((kb_err = cudaGetLastError()) != cudaSuccess) return (int)kb_err;",
              "  }"]
    L += ["  return 0;", "}", ""]
    if abi.value_dim:
        L += _value_dispatch()
    L += [f'extern "C" int {LAUNCH_SYMBOL}(void* const* ptrs, const long long* strides, const long long* dims, '
          "const double* scalars, void* stream) {",
          "  KbArgs kb_a;"]
    L += fill_args(abi)
    L += pre_launch or []
    L.append("  cudaStream_t kb_stream = static_cast<cudaStream_t>(stream);")
    run = (lambda hp: f"kb_run_v<{hp}>(kb_a, kb_stream, kb_hpv)") if abi.value_dim else (lambda hp: f"kb_run<{hp}>(kb_a, kb_stream)")
    if abi.value_dim:
        L.append(f"  long long kb_hpv = {DOT_MIN_K};")
        L.append(f"  while (kb_hpv < kb_a.{cxx_name(VALUE_DIM)}) kb_hpv *= 2;")
    if abi.head_pad:
        L.append(f"  return {run(abi.head_pad)};")
    else:
        if "D" not in abi.dims:
            raise KBError(f"program {p.name}: head_pad=0 needs a dim named D to dispatch on; set schedule head_pad")
        L.append(f"  long long kb_hp = {DOT_MIN_K};")
        L.append("  while (kb_hp < kb_a.D) kb_hp *= 2;")
        L.append("#ifdef KB_HEAD_PAD_ONLY  // a faster build with one instantiation (-DKB_HEAD_PAD_ONLY=64)")
        L.append(f"  return kb_hp == KB_HEAD_PAD_ONLY ? {run('KB_HEAD_PAD_ONLY')} : {_err_name()};")
        L.append("#else")
        L.append("  switch (kb_hp) {")
        for hp in HEAD_PADS:
            L.append(f"    case {hp}: return {run(hp)};")
        L.append(f"    default: return {_err_name()};")
        L.append("  }")
        L.append("#endif")
    L += ["}", "",
          f'extern "C" const char* {ERROR_SYMBOL}(int code) {{',
          f'  if (code == {_err_name()}) return "no kernel was compiled for this head dim (the largest HEAD_PAD is {HEAD_PADS[-1]})";',
          '  if (code == KB_ERR_SMEM) return "the tiles of this design need more shared memory per block than this GPU '
          'allows at this head dim (BLOCK_M x BLOCK_N tiles, fp32 score buffers): choose a design with smaller tiles";',
          *(f'  if (code == {c}) return "{msg}";' for c, msg in (errors or {}).items()),
          "  return cudaGetErrorString(static_cast<cudaError_t>(code));",
          "}"]
    return L


def fill_args(abi: LaunchAbi) -> list[str]:
    """`kb_launch`'s lines filling `KbArgs kb_a` from (ptrs, strides, dims, scalars) in `LaunchAbi` order."""
    L: list[str] = []
    off = 0
    for i, t in enumerate(abi.tensors):
        const = "const " if t.role in (Role.IN, Role.AUX) else ""
        L.append(f"  kb_a.{cxx_name(t.name)} = static_cast<{const}{CTYPE[t.dtype]}*>(ptrs[{i}]);")
        for j in range(len(t.shape)):
            L.append(f"  kb_a.{cxx_name(t.name)}_stride[{j}] = strides[{off + j}];")
        off += len(t.shape)
    for i, d in enumerate(abi.dims):
        L.append(f"  kb_a.{cxx_name(d)} = dims[{i}];")
    for i, s in enumerate(abi.scalars):
        L.append(f"  kb_a.{cxx_name(s)} = (float)scalars[{i}];")
    if abi.table:
        table = abi.table
        L.append(f"  kb_a.bc = static_cast<const signed char*>(ptrs[{len(abi.tensors)}]);")
        L.append(f"  kb_a.bc_size[0] = {'kb_a.' + cxx_name(table.b_dim) if table.per_b else '1'};")
        L.append(f"  kb_a.bc_size[1] = {'kb_a.' + cxx_name(table.h_dim) if table.per_h else '1'};")
        L.append(f"  kb_a.bc_size[2] = kb_cdiv(kb_a.{cxx_name(table.m_dim)}, BLOCK_M);")
        L.append(f"  kb_a.bc_size[3] = kb_cdiv(kb_a.{cxx_name(table.n_dim)}, BLOCK_N);")
    return L


def _value_dispatch() -> list[str]:
    """`kb_run_v<HEAD_PAD>`: the runner for the padded value head dim (programs with a `Dv`)."""
    L = ["template <int HEAD_PAD>", "static int kb_run_v(const KbArgs& kb_a, cudaStream_t kb_stream, long long kb_hpv) {",
         "#ifdef KB_HEAD_PAD_V_ONLY  // a faster build with one instantiation (-DKB_HEAD_PAD_V_ONLY=128)",
         f"  return kb_hpv == KB_HEAD_PAD_V_ONLY ? kb_run<HEAD_PAD, KB_HEAD_PAD_V_ONLY>(kb_a, kb_stream) : {_err_name()};",
         "#else", "  switch (kb_hpv) {"]
    L += [f"    case {hp}: return kb_run<HEAD_PAD, {hp}>(kb_a, kb_stream);" for hp in HEAD_PADS]
    return L + [f"    default: return {_err_name()};", "  }", "#endif", "}", ""]
