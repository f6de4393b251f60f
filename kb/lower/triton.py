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

from dataclasses import dataclass

from kb.ir.design import DesignTable
from kb.ir.nodes import (
    IfBlock, Program, Role, SCHEDULE_CONSTANTS, VALUE_DIM, is_backward, launch_constants,
    walk_stmts,
)
from kb.lower.block_mask import BlockMaskKind, BlockMaskPlan, plan_block_mask
from kb.lower.cuda_dispatch import CudaDispatch, dispatch_section
from kb.lower.kernel_gen import check_attention_params
from kb.lower.pack_gqa import PackPlan, pack_plans
from kb.lower.preambles import preamble_text
from kb.lower.triton_host import check_host_names, class_kernel, design_lines, host_function, kernel_fn_name, packed_fn_name, split_kernels
from kb.lower.triton_kernel import TritonKernelGen
from kb.lower.triton_op import op_section
from kb.lower.triton_tiles import Signature

__all__ = ["lower_program", "forward_module", "LowerOptions", "program_signature", "kernel_sources", "check_attention_params", "PREAMBLE"]


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


# ------------------------------------------------------------------ module


PREAMBLE = preamble_text("triton_preamble.py")  # at the top of every generated module


def lower_program(p: Program, options: LowerOptions | None = None, designs: DesignTable | None = None,
                  cuda: CudaDispatch | None = None) -> str:
    """The source text of a standalone Python module running `p` with Triton.

    `designs` ({arch: {head-dim bucket: designs best first}}) are the launch parameters the module picks from on a
    GPU; without them (or for a GPU they miss) it times what it has once per shape, including the program's schedule.
    A forward module ends with its operator section (kb.lower.triton_op: `torch.ops.kernel_kb.<OP_NAME>`,
    `kb_attention`), forward-only: its backward raises NO_BACKWARD. `cuda`: where its forward runs the `.cu` beside it
    instead (kb.lower.cuda_dispatch)."""
    if is_backward(p):
        from kb.lower.triton_bwd import lower_backward

        return lower_backward(p, options or LowerOptions(), designs)
    text = forward_module(p, options, designs, cuda)
    return text + op_section(p, text, cuda=bool(cuda))


def forward_module(p: Program, options: LowerOptions | None = None, designs: DesignTable | None = None,
                   cuda: CudaDispatch | None = None) -> str:
    """`lower_program`'s module up to its operator section: the preamble, the kernels, the host `forward` and, with
    `cuda`, the CUDA dispatch."""
    opts = options or LowerOptions()
    check_attention_params(p, "Triton")
    check_host_names(p)
    plan = plan_block_mask(p)
    sig = program_signature(p, opts, plan)
    packs = _packing(p, opts, designs)
    out = [f'"""Triton kernels for IR program `{p.name}`: generated by kb.lower.triton, do not edit."""', "", PREAMBLE]
    out += kernel_sources(p, sig, plan, opts, packs)
    if sig.table:
        out += ["", *class_kernel(p, sig, plan)]
    out += ["", *design_lines(p, designs, packs), *host_function(p, sig, plan, packs)]
    if cuda:
        out += dispatch_section(p, cuda.source, cuda)
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


def _packing(p: Program, opts: LowerOptions, designs: DesignTable | None) -> dict[str, PackPlan] | str:
    """The kernels' pack plans when the module should carry packed forms (a split-KV program, or a design that
    packs), else why not: a prefill module whose designs never pack stays as it was."""
    split = bool(split_kernels(p))
    if not opts.pack_gqa:
        return "the lowering was asked not to pack (LowerOptions.pack_gqa)"
    if not split and not any(d.pack_gqa for by in (designs or {}).values() for ds in by.values() for d in ds):
        return "not a split-KV program and no design packs"
    return pack_plans(p)
