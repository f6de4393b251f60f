"""Program -> Triton source: one `@triton.jit` function per IR kernel plus a host `forward`.

Where the parts are made: the kernels by kb.lower.triton_kernel (statements) over kb.lower.triton_tiles (tiles,
names, addressing); block classes are planned by kb.lower.block_mask; the runtime preamble is
kb/lower/triton_preamble.py; this module assembles them with the design table and the host function.

Reference-guided: the statement structure of the Program decides the code shape. Each IR
statement becomes a few lines in the FlashAttention-2 Triton forward style (q tile in
registers, K/V streamed by the `for` loop with the IR's exact bounds, `tl.dot` with fp32
accumulation, `p` cast to v's dtype before the second dot, exp2 with log2(e) folded into
one multiply-add).

Invariants of the generated module:
- It is standalone (imports only math, os, torch, triton) and importable from a file.
- Every tensor gets explicit strides, so non-contiguous inputs work; every tile load/store
  is masked by the extents of the dims it spans (ragged lengths, HEAD_PAD > D).
- The online-softmax state keeps the IR's natural-log meaning (`m` is the natural row
  max); only the exponentials use exp2 on `x * log2(e) - m * log2(e)` (one FMA, as FA2).
- Fully masked rows never produce NaN: the max used in the exponent is 0 while the row
  max is -inf, `finalize` divides by 1 where l == 0 and gives lse = -inf there.
- `if block(...) is CLASS` is decided in closed form on (q_start, kv_start) when the
  mask_mod is an `|` of conjunctions of bounds, each on one linear form in q_idx/kv_idx with
  unit coefficients (causal, sliding window, offsets; prefix-LM with a constant, 0-d or
  per-batch prefix, whose bounds load `prefix[b]` once per program); otherwise the module's
  `_block_class_kernel` fills a block-class table [B|1, H|1, n_m_blocks, n_n_blocks] int8 on
  the GPU (one program per tile), kept while the mask's inputs are unchanged.
  Table codes: 0 empty, 1 partial, 2 full; an unaligned tile start reads as partial.
  From it the host also builds per-row lists of partial and of full blocks, which a KV loop
  over such a mask iterates instead of every block (LowerOptions.indexed_kv_loop).
- Loads in mask_mod / score_mod that do not move along the KV loop (`doc[b, q_idx]`, `prefix[b]`,
  `slopes[h]`) are loaded once before the outermost loop.
- The IR's HEAD_PAD=0 means max(16, next_pow2(D)) here (`tl.dot` needs K >= 16 on GPUs;
  the extra columns are zero-padded and masked, so results do not change); a program with a
  value head dim `Dv` (kb.ir.value_dim) also gets HEAD_PAD_V = max(16, next_pow2(Dv)) and
  EVEN_DV, which only such programs receive.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kb.errors import KBError
from kb.ir.design import Design, DesignTable
from kb.ir.expr import free_vars, loaded_tensors
from kb.ir.nodes import (
    IfBlock, Kernel, Param, Program, Role, SCHEDULE_CONSTANTS, VALUE_DIM, is_backward, launch_constants,
    serving_constructs, walk_stmts,
)
from kb.lower.block_mask import EMPTY, FULL, PARTIAL, BlockMaskKind, BlockMaskPlan, plan_block_mask
from kb.lower.expr_context import DTYPE_KIND, AuxRef, ExprContext, ExprTarget, Kind, Sym
from kb.lower.pack_gqa import PACK_ROWS, PackPlan, pack_plans
from kb.lower.triton_code import TORCH_DTYPE, strip_parens, wrap
from kb.lower.triton_expr import lower_expr
from kb.lower.triton_kernel import TritonKernelGen
from kb.lower.triton_tiles import Signature

__all__ = ["lower_program", "LowerOptions", "kernel_fn_name", "HostEntry", "program_signature", "kernel_sources",
           "check_attention_params"]


@dataclass(frozen=True)
class LowerOptions:
    """Speed transformations of the lowering; each keeps the IR's semantics exactly.

    - split_kv_loop: a forward KV loop whose masks/block-class tests all concern the loop's own
      (BLOCK_M x BLOCK_N) tile, under a closed-form plan (no mask, or bounds on q_idx - kv_idx),
      becomes three loops: partial blocks, full blocks (no mask code, unmasked K/V loads), partial
      blocks. Full blocks form one interval of kv_start, computed in closed form per program.
    - fold_scale: `s = s * c` (c a positive scalar param, checked on the host) followed only by
      masks and online_softmax is folded into the softmax's exp2 argument (one FMA per score).
    - even_headdim: loads/stores over the head dim drop the `< D` mask when D == HEAD_PAD (constexpr), and
      those over the value head dim the `< Dv` mask when Dv == HEAD_PAD_V (EVEN_DV).
    - heavy_first: grids whose last axis moves the KV loop bound (causal-like) run that axis in
      reverse, so the longest programs start first and the tail of the launch is short.
    - tma (Hopper fast path): 2-D tile loads (fill 0) and stores of float tensors
      `t[e0, .., Span|Full, Span|Full]` also get a tensor-descriptor form
      (`tl.make_tensor_descriptor` over the [rows, cols] slice at the leading indices, so Triton
      uses the TMA copy engine and zero-fills / clips out-of-range rows and columns exactly as the
      masked form does). The host picks the form at launch (USE_TMA constexpr): only on a CUDA
      device of compute capability >= 9.0, not interpreting, with every such tensor's last dim
      contiguous, its base and other strides 16-byte aligned, and tile sides <= 256. Descriptors
      of loads inside a loop are built once before the outermost loop when their leading indices
      do not change in it. Measured on H200 (causal/plain D=128 S=8K, bench/results/hopper_h200.json):
      +5% / +10% at 128x128 w8 s3; at 128x64 it is no faster.
    - warp_specialize (off by default): with USE_TMA and the schedule's `warp_specialize` hint,
      innermost forward loops become `tl.range(..., warp_specialize=True)` (WARP_SPEC constexpr).
      Triton 3.6 on H200 gave no gain (w8) and failed to compile at num_warps=4 (NVGPUWarpSpecialization).
    - pack_gqa: kernels that pass `kb.lower.pack_gqa.pack_plans` also get a packed form (`_<name>_packed_kernel`):
      the query heads of one KV head become tile rows, so K/V are read once per KV head and split instead of
      Hq // Hkv times. The host runs it when the design asks (Design.pack_gqa) and Hq > Hkv; a split-KV
      program's own schedule (PROGRAM_DESIGN, what the interpreter verifies) packs.
    - indexed_kv_loop: the same split under a host-table plan (data-dependent masks such as
      document ids or a per-batch prefix), where full blocks are not one interval: the host turns
      the block-class table into per-row lists of partial and of full KV blocks (FlexAttention's
      kv_indices / full_kv_indices) and the loop becomes two loops over those lists, partial blocks
      first, then full ones (no mask code); empty blocks are never visited. Needs the tile's
      q_start and the loop's lower bound to be multiples of BLOCK_M / BLOCK_N (checked statically).
    """

    split_kv_loop: bool = True
    fold_scale: bool = True
    even_headdim: bool = True
    heavy_first: bool = True
    tma: bool = True
    warp_specialize: bool = False
    indexed_kv_loop: bool = True
    pack_gqa: bool = True


def kernel_fn_name(k: Kernel) -> str:
    return f"_{k.name}_kernel"


# ------------------------------------------------------------------ module


def _preamble_text() -> str:
    """The runtime preamble pasted into every generated module: kb/lower/triton_preamble.py between its markers
    (read as text: generating a module imports neither torch nor triton)."""
    text = (Path(__file__).parent / "triton_preamble.py").read_text()
    begin = text.index("\n", text.index("# ---- generated modules: preamble begins")) + 1
    return text[begin:text.index("# ---- generated modules: preamble ends")]


_PREAMBLE = _preamble_text()


def lower_program(p: Program, options: LowerOptions | None = None, designs: DesignTable | None = None) -> str:
    """The source text of a standalone Python module running `p` with Triton.

    `designs` ({arch: {head-dim bucket: designs best first}}) are the launch parameters the module picks from on a
    GPU; without them (or for a GPU they miss) it times what it has once per shape, including the program's schedule."""
    opts = options or LowerOptions()
    if is_backward(p):
        from kb.lower.triton_bwd import lower_backward

        return lower_backward(p, opts, designs)
    check_attention_params(p, "Triton")
    plan = plan_block_mask(p)
    sig = program_signature(p, opts, plan)
    packs = _packing(p, opts, designs)
    out = [f'"""Triton kernels for IR program `{p.name}`: generated by kb.lower.triton, do not edit."""', "", _PREAMBLE]
    out += kernel_sources(p, sig, plan, opts, packs)
    if sig.table:
        out += ["", *_class_kernel(p, sig, plan)]
    out += ["", *_design_lines(p, designs, packs), *_host(p, sig, plan, packs)]
    return "\n".join(out).rstrip() + "\n"


def program_signature(p: Program, opts: LowerOptions, plan: BlockMaskPlan) -> Signature:
    """The argument list every kernel of `p` receives (completed while the kernels are generated)."""
    has_if = any(isinstance(st, IfBlock) for k in p.kernels for st in walk_stmts(k.body))
    tensors = tuple(q for q in p.params if q.role is not Role.SCALAR)
    runtime_dims = tuple(d for d in p.dims() if d not in SCHEDULE_CONSTANTS)
    return Signature(tensors, runtime_dims, tuple(q for q in p.params if q.role is Role.SCALAR),
                      table=has_if and plan.kind is BlockMaskKind.TABLE, even_d=opts.even_headdim and "D" in runtime_dims,
                      even_dv=opts.even_headdim and VALUE_DIM in runtime_dims, consts=launch_constants(p),
                      tma=opts.tma, ws=opts.tma and opts.warp_specialize)


def kernel_sources(p: Program, sig: Signature, plan: BlockMaskPlan, opts: LowerOptions, packs: dict | str) -> list[str]:
    """The `@triton.jit` functions of `p`'s kernels (and their packed forms), all with the final shared signature."""
    bodies = [(kernel_fn_name(k), TritonKernelGen(p, k, sig, plan, opts).generate()) for k in p.kernels]
    if isinstance(packs, dict):
        bodies += [(packed_fn_name(k), TritonKernelGen(p, k, sig, plan, opts, packs[k.name]).generate()) for k in p.kernels]
    out: list[str] = []
    for fn, lines in bodies:
        args = sig.args() + [f"{c}: tl.constexpr" for c in sig.constexprs()]
        out += ["", "@triton.jit", f"def {fn}(", *(f"    {a}," for a in args), "):", *lines, ""]
    return out


def _class_kernel(p: Program, sig: Signature, plan: BlockMaskPlan, name: str = "_block_class_kernel") -> list[str]:
    """`_block_class_kernel`: one program per (b, h, m block, n block) of the table writes that tile's class of
    mask_mod (0 empty, 1 partial, 2 full; a tile past N is never full), evaluated in registers on the GPU."""
    assert p.mask_mod is not None
    aux = [q for q in p.params if q.role is Role.AUX]
    q_shape, m_dim, n_dim = p.param("q").shape, str(p.param("q").shape[2]), str(p.param("k").shape[2])
    names = {d: Sym(d, Kind.INT, True) for d in (*sig.dims, *SCHEDULE_CONSTANTS)}
    names.update({q.name: Sym(q.name, DTYPE_KIND[q.dtype]) for q in sig.scalars})
    for n, dim, used in (("b", q_shape[0], plan.per_b), ("h", q_shape[1], plan.per_h)):
        names[n] = Sym(n, Kind.INT, True, str(dim) if used and isinstance(dim, str) else None)
    names["q_idx"] = Sym("offs_q[:, None]", Kind.INT, True)
    names["kv_idx"] = Sym("offs_kv[None, :]", Kind.INT, True)
    refs = {q.name: AuxRef(f"{q.name}_ptr", tuple(f"stride_{q.name}_{i}" for i in range(len(q.shape))),
                           tuple(str(d) for d in q.shape), DTYPE_KIND[q.dtype]) for q in aux}
    mask = strip_parens(lower_expr(p.mask_mod.body, ExprContext(ExprTarget.DEVICE, names, refs)))
    args = [f"{q.name}_ptr" for q in aux] + [f"stride_{q.name}_{i}" for q in aux for i in range(len(q.shape))] \
        + list(sig.dims) + [q.name for q in sig.scalars] \
        + ["bc_ptr", "stride_bc_0", "stride_bc_1", "stride_bc_2", "stride_bc_3", "bc_nh", "bc_nm", "bc_nn",
           "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"]
    body = [
        "# one program per tile of the table [nb, nh, nm, nn], flattened; the mask is evaluated in registers",
        "pid = tl.program_id(0)",
        "j = pid % bc_nn",
        "pid = pid // bc_nn",
        "m = pid % bc_nm",
        "pid = pid // bc_nm",
        "h = pid % bc_nh",
        "b = pid // bc_nh",
        "offs_q = m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "offs_kv = j * BLOCK_N + tl.arange(0, BLOCK_N)",
        f"in_range = (offs_q[:, None] < {m_dim}) & (offs_kv[None, :] < {n_dim})",
        f"attend = in_range & {wrap(mask)}",
        "n_in = tl.sum(tl.sum(in_range.to(tl.int32), 1), 0)",
        "n_att = tl.sum(tl.sum(attend.to(tl.int32), 1), 0)",
        f"cls = tl.where(n_att == 0, {EMPTY}, tl.where((n_att == n_in) & ((j + 1) * BLOCK_N <= {n_dim}), {FULL}, {PARTIAL}))",
        "tl.store(bc_ptr + b * stride_bc_0 + h * stride_bc_1 + m * stride_bc_2 + j * stride_bc_3, cls.to(tl.int8))",
    ]
    return ["@triton.jit", f"def {name}(", *(f"    {a}," for a in args), "):", *(f"    {x}" for x in body), ""]


def _split_kernels(p: Program) -> list[Kernel]:
    """The kernels with a split-KV grid axis (an extent over NUM_SPLITS)."""
    return [k for k in p.kernels if any("NUM_SPLITS" in free_vars(a.extent) for a in k.grid)]


def packed_fn_name(k: Kernel) -> str:
    return f"_{k.name}_packed_kernel"


def _packing(p: Program, opts: LowerOptions, designs: DesignTable | None) -> dict[str, PackPlan] | str:
    """The kernels' pack plans when the module should carry packed forms (a split-KV program, or a design that
    packs), else why not: a prefill module whose designs never pack stays as it was."""
    split = bool(_split_kernels(p))
    if not opts.pack_gqa:
        return "the lowering was asked not to pack (LowerOptions.pack_gqa)"
    if not split and not any(d.pack_gqa for by in (designs or {}).values() for ds in by.values() for d in ds):
        return "not a split-KV program and no design packs"
    return pack_plans(p)


def check_attention_params(p: Program, lowering: str) -> None:
    """Both lowerings need q and k as [B, H, S, D] params and no varlen/paged index forms; KBError naming the lowering otherwise."""
    if constructs := serving_constructs(p):
        raise KBError(f"program {p.name}: the {lowering} lowering does not support {' or '.join(constructs)}; "
                      "lowering of varlen/paged programs is not supported yet (run them with kb.ir.interpret)")
    for name in ("q", "k"):
        try:
            prm = p.param(name)
        except KeyError:
            raise KBError(f"program {p.name}: the {lowering} lowering needs a param {name!r} [B, H, S, D]") from None
        if len(prm.shape) != 4:
            raise KBError(f"program {p.name}: {name} must be [B, H, S, D], got {prm.shape}")


def _design_lines(p: Program, designs: DesignTable | None, packs: dict | str) -> list[str]:
    """Module constants: the design table (per arch and head-dim bucket, best first) and the program's own schedule.

    A program that cannot pack lists its designs unpacked (deduplicated), so the table says what runs; a split-KV
    program that can pack verifies its packed form (its own schedule packs)."""
    packable = isinstance(packs, dict)

    def tuples(ds: tuple[Design, ...]) -> list[tuple]:
        return list(dict.fromkeys(d.as_tuple() if packable else dataclasses.replace(d, pack_gqa=False).as_tuple() for d in ds))

    table = {arch: {bucket: tuples(ds) for bucket, ds in sorted(by.items())} for arch, by in sorted((designs or {}).items())}
    split = bool(_split_kernels(p))
    own = Design.of_schedule(p.schedule, tma=True, pack_gqa=packable and split).as_tuple()
    return [f"PROGRAM = {p.name!r}",
            "# Designs per GPU arch and head-dim bucket, best first, chosen by kernel-kb from what its KB knew",
            "# (measured records, expert tunables): (BLOCK_M, BLOCK_N, NUM_SPLITS, num_warps, num_stages, tma, pack_gqa);",
            "# NUM_SPLITS 0 = chosen at launch from the grid and the SM count",
            f"# GQA packing: {'available (designs with pack_gqa run the packed kernels)' if packable else 'not used, ' + packs}",
            f"DESIGNS = {table!r}",
            "# the program's own schedule: run by the interpreter (and verified there), and timed on a GPU the table misses",
            f"PROGRAM_DESIGN = {own!r}", "", ""]


def _out_dtype(q: Param, first_in: Param) -> str:
    """The attention output (a tile tensor of q's rank, typed like q in the IR) follows the inputs' dtype at run
    time (bf16 in, bf16 out); any other declared dtype (the LSE's f32, a spec's deliberate fp32 output) is kept."""
    if q.dtype == first_in.dtype and len(q.shape) == len(first_in.shape):
        return f"{first_in.name}.dtype"
    return TORCH_DTYPE[q.dtype]


@dataclass(frozen=True)
class HostEntry:
    """What a module's host function is: the forward's `forward` by default; kb.lower.triton_bwd makes `backward`
    (its own design chooser and block-class kernel, so it can sit in one module beside a forward)."""

    name: str = "forward"
    chooser: str = "_choose_design"  # picks the design per GPU and shape
    class_kernel: str = "_block_class_kernel"
    table_tag: str = ""  # leading entries of the block-table cache key (code), e.g. '"bwd", '
    zeroed: tuple[str, ...] = ()  # tensors allocated zero-filled (accumulated into)
    returns: tuple[str, ...] = ()  # the returned expressions; () = the OUT params
    table_helper: bool = True  # emit block_class_table()


def _host(p: Program, sig: Signature, plan: BlockMaskPlan, packs: dict | str, entry: HostEntry = HostEntry()) -> list[str]:
    ins = [q for q in p.params if q.role is Role.IN]
    aux = [q for q in p.params if q.role is Role.AUX]
    outs = [q for q in p.params if q.role is Role.OUT]
    scratch = [q for q in p.params if q.role is Role.SCRATCH]
    scalars = [q for q in p.params if q.role is Role.SCALAR]
    names = {d: Sym(d, Kind.INT, True) for d in (*sig.dims, *SCHEDULE_CONSTANTS)}
    names.update({q.name: Sym(q.name, DTYPE_KIND[q.dtype]) for q in scalars})
    hctx = ExprContext(ExprTarget.HOST, names)
    sig_text = ", ".join(q.name for q in ins) + ", *" + (", sm_scale=None" if any(q.name == "sm_scale" for q in scalars) else "")
    returned = ", ".join(entry.returns or tuple(q.name for q in outs))
    L = [f"def {entry.name}({sig_text}, _design=None, **aux_and_scalars):",
         f'    """Run `{p.name}`. Returns ({returned}). '
         f'Aux tensors: {", ".join(q.name for q in aux) or "none"}; scalars: {", ".join(q.name for q in scalars) or "none"}.',
         "    The design (tiles, warps, stages) is chosen per GPU and shape from DESIGNS; `_design=` forces one.\"\"\"",
         "    kw = dict(aux_and_scalars)"]
    for q in aux:
        L.append(f'    if "{q.name}" not in kw:')
        L.append(f'        raise ForwardArgumentError("{entry.name}() needs the aux tensor {q.name}={list(q.shape)}")')
        L.append(f'    {q.name} = kw.pop("{q.name}")')
    L.append("    dims = {}")
    for q in (*ins, *aux):
        L.append(f'    _bind(dims, "{q.name}", {q.name}, {tuple(q.shape)!r})')
    for d in sig.dims:
        L.append(f'    {d} = dims["{d}"]')
    for q in scalars:
        if q.name == "sm_scale":
            L.append(f"    sm_scale = 1.0 / math.sqrt({ins[0].name}.shape[-1]) if sm_scale is None else float(sm_scale)")
        else:
            L.append(f'    if "{q.name}" not in kw:')
            L.append(f'        raise ForwardArgumentError("{entry.name}() needs the scalar {q.name}=...")')
            L.append(f'    {q.name} = float(kw.pop("{q.name}"))')
    if sig.table:  # like FlexAttention's block mask: built once by the caller and passed back, or built here
        L.append('    block_class, only_table = kw.pop("block_class", None), kw.pop("_only_block_class", False)')
    L.append("    if kw:")
    L.append(f'        raise ForwardArgumentError(f"{entry.name}() got unexpected arguments: {{sorted(kw)}}")')
    L.append("")
    L.append("    def launch(design, table_only=False):")
    L += ["    " + line if line else line for line in _launch_body(p, sig, plan, hctx, names, ins, aux, outs, scratch, packs, entry)]
    L.append("")
    first = ins[0].name
    dims_key = ", ".join(sig.dims)
    d_dim = "D" if "D" in sig.dims else f"{first}.shape[-1]"
    L.append(f"    design = tuple(_design) if _design is not None else {entry.chooser}({first}, {d_dim}, "
             f"({first}.device, {first}.dtype, {dims_key}{',' if len(sig.dims) == 1 else ''}), launch)")
    if sig.table:
        L.append("    return launch(design, table_only=only_table)")
    else:
        L.append("    return launch(design)")
    if sig.table and entry.table_helper:
        L += ["", "", "def block_class_table(*args, **kw):",
              '    """(block classes, block lists) forward(*args, **kw) builds; pass it back as block_class= to reuse it."""',
              "    return forward(*args, _only_block_class=True, **kw)"]
    return L


def _grid_code(k: Kernel, hctx: ExprContext, pack: PackPlan | None, split: bool = True) -> str:
    """The host's launch-grid size of kernel `k` (packed: over KV heads and packed row blocks); without the
    split axes when `split` is False."""
    axes = [a for a in k.grid if split or "NUM_SPLITS" not in free_vars(a.extent)]
    return " * ".join(wrap(lower_expr(pack.extent(a.name, a.extent) if pack else a.extent, hctx)) for a in axes) or "1"


def _launch_body(p: Program, sig: Signature, plan: BlockMaskPlan, hctx: ExprContext, names: dict,
                 ins: list[Param], aux: list[Param], outs: list[Param], scratch: list[Param], packs: dict | str,
                 entry: HostEntry = HostEntry()) -> list[str]:
    """The body of the host's `launch(design)`: allocate outputs, build the block table, launch every kernel."""
    s = p.schedule
    scalars = [q for q in p.params if q.role is Role.SCALAR]
    L = ["    BLOCK_M, BLOCK_N, NUM_SPLITS, num_warps, num_stages, tma, PACK = _design7(design)"]
    if isinstance(packs, dict):
        pk = next(iter(packs.values()))
        hctx = ExprContext(hctx.target, {**hctx.names, PACK_ROWS: Sym("_PK_ROWS", Kind.INT, True)}, hctx.aux)
        L.append(f"    # GQA packing: the {pk.hq} // {pk.hkv} query heads of a KV head share a tile (K/V read once per KV head)")
        L.append(f"    PACK = PACK and {pk.hq} > {pk.hkv} and {pk.hq} % {pk.hkv} == 0")
        L.append(f"    _PK_ROWS = ({pk.hq} // {pk.hkv}) * {pk.m}")
    split_kernels = _split_kernels(p)
    if split_kernels:
        k0 = split_kernels[0]
        base = _grid_code(k0, hctx, None, split=False)
        if isinstance(packs, dict):
            base = f"({_grid_code(k0, hctx, packs[k0.name], split=False)} if PACK else {base})"
        L.append(f"    NUM_SPLITS = NUM_SPLITS or _auto_splits({base}, _hcdiv(N, BLOCK_N), {ins[0].name}.device)")
    else:
        L.append("    NUM_SPLITS = max(1, NUM_SPLITS)")
    head_pad = str(s.head_pad) if s.head_pad else "max(16, triton.next_power_of_2(D))"
    L.append(f"    HEAD_PAD = {head_pad}")
    if "D" in sig.dims:
        L.append("    if HEAD_PAD < D:")
        L.append('        raise ForwardArgumentError(f"schedule head_pad={HEAD_PAD} is smaller than the head dim D={D}")')
    for pad in sig.pads:
        L.append(f"    {pad} = triton.next_power_of_2({pad[4:]})")
    if VALUE_DIM in sig.dims:
        L.append(f"    HEAD_PAD_V = max(16, triton.next_power_of_2({VALUE_DIM}))")
    if sig.even_d:
        L.append("    EVEN_D = HEAD_PAD == D")
    if sig.even_dv:
        L.append(f"    EVEN_DV = HEAD_PAD_V == {VALUE_DIM}")
    for name in sig.pos_scalars:
        L.append(f"    POS_{name} = {name} > 0")
    device = ins[0].name + ".device"
    table_args: list[str] = []
    if sig.table:
        assert p.mask_mod is not None
        qshape = p.param("q").shape
        nb = str(qshape[0]) if plan.per_b else "1"
        nh = str(qshape[1]) if plan.per_h else "1"
        L.append("    # block classes of mask_mod (not decidable in closed form): one GPU program per tile")
        used = sorted(free_vars(p.mask_mod.body) & {q.name for q in (*aux, *scalars)} | loaded_tensors(p.mask_mod.body))
        tensors_used = ", ".join(n for n in used if n in {q.name for q in aux})
        scalars_used = ", ".join(n for n in used if n in {q.name for q in scalars})
        cargs = ", ".join([q.name for q in aux] + [f"*{q.name}.stride()" for q in aux] + list(sig.dims)
                          + [q.name for q in scalars] + ["bc", "*bc.stride()", "*bc.shape[1:]"])
        L.append(f"    classes = lambda bc: {entry.class_kernel}[(bc.numel(),)]({cargs}, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)")
        L.append("    # rebuilt only when the mask's inputs change (compared by content), as FlexAttention's block mask is built once")
        L.append(f"    table = block_class if block_class is not None else _cached_table(({entry.table_tag}BLOCK_M, BLOCK_N, "
                 f"{', '.join(sig.dims)}, "
                 f"{scalars_used}{',' if scalars_used else ''}), ({tensors_used}{',' if tensors_used else ''}), "
                 f"lambda: _hblock_table(_hblock_classes(classes, {nb}, {nh}, {qshape[2]}, {p.param('k').shape[2]}, "
                 f"BLOCK_M, BLOCK_N, {device})))")
        L.append("    if table_only:")
        L.append("        return table")
        L.append("    bc, kvl = table")
        table_args = ["bc", "*bc.stride()", "*bc.shape", "kvl", "*kvl.stride()"]
    for q in (*outs, *scratch):
        shape = ", ".join(str(d) for d in q.shape)
        dtype = _out_dtype(q, ins[0]) if q.role is Role.OUT else TORCH_DTYPE[q.dtype]
        alloc = "zeros" if q.name in entry.zeroed else "empty"
        L.append(f"    {q.name} = torch.{alloc}(({shape},), dtype={dtype}, device={device})")
    if sig.tma:
        tma_ts = ", ".join(sig.tma_tensors) + ("," if len(sig.tma_tensors) == 1 else "")
        L.append("    # Hopper: tile loads/stores through tensor descriptors (TMA) where the GPU and layouts allow")
        sides = "BLOCK_M, BLOCK_N, HEAD_PAD" + (", HEAD_PAD_V" if VALUE_DIM in sig.dims else "")
        L.append(f"    USE_TMA = tma and _use_tma(({tma_ts}), ({sides}))")
    if sig.ws:
        L.append(f"    WARP_SPEC = USE_TMA and {bool(s.warp_specialize)}")
    args = [q.name for q in sig.tensors] + [f"*{q.name}.stride()" for q in sig.tensors] + list(sig.dims) \
        + [q.name for q in sig.scalars] + table_args
    const_kw = ", ".join(f"{c}={c}" for c in sig.constexprs())
    for k in p.kernels:
        launches = [(kernel_fn_name(k), _grid_code(k, hctx, None))]
        if isinstance(packs, dict):
            launches.insert(0, (packed_fn_name(k), _grid_code(k, hctx, packs[k.name])))
        for i, (fn, grid) in enumerate(launches):
            indent = "        " if len(launches) > 1 else "    "
            if len(launches) > 1:
                L.append("    if PACK:" if i == 0 else "    else:")
            L.append(f"{indent}{fn}[({grid},)](")
            L.append(f"{indent}    {', '.join(args)},")
            L.append(f"{indent}    {const_kw}, num_warps=num_warps, num_stages=num_stages,")
            L.append(f"{indent})")
    L.append(f"    return {', '.join(entry.returns or tuple(q.name for q in outs))}")
    return L
