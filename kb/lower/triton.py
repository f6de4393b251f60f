"""Program -> Triton source: one `@triton.jit` function per IR kernel plus a host `forward`.

Where the parts are made: the kernels by kb.lower.triton_kernel (statements) over kb.lower.triton_tiles (tiles,
names, addressing); block classes are planned by kb.lower.block_mask; the runtime preamble is
kb/lower/triton_preamble.py; kb.lower.triton_forward assembles them with the design table and the host function
(options: kb.lower.triton_options), kb.lower.triton_bwd does the same for backward programs, and this module's
`lower_program` is the entry for both.

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
- Serving layouts (kb.lower.serving: token-major [T, H, D] varlen, [B, Hq, D] decode q, paged [NUM_PAGES, PAGE, Hkv, D]
  caches, token pools through a gathered axis) lower through the same statements: a span's `until` and a gathered
  lane's validity join the load/store masks, a table-loaded scalar index (a page number) is range-checked, and a dot
  with a tile side below 16 (a decode step's one query row, a schedule's block of 8) is a broadcast multiply-sum in
  fp32. Such a module runs its program's own schedule (no design table, no tensor descriptors, no GQA packing, no
  KV-loop split) and refuses block-class tests, split-KV grids, attention sinks and backward programs for now.
- The IR's HEAD_PAD=0 means max(16, next_pow2(D)) here (`tl.dot` needs K >= 16 on GPUs;
  the extra columns are zero-padded and masked, so results do not change); a program with a
  value head dim `Dv` (kb.ir.value_dim) also gets HEAD_PAD_V = max(16, next_pow2(Dv)) and
  EVEN_DV, which only such programs receive.
"""

from __future__ import annotations

from kb.ir.design import DesignTable
from kb.ir.nodes import Program, is_backward
from kb.lower.cuda_dispatch import CudaDispatch
from kb.lower.kernel_gen import check_attention_params
from kb.lower.triton_bwd import lower_backward
from kb.lower.triton_forward import PREAMBLE, forward_module, kernel_sources, program_signature
from kb.lower.triton_op import op_section
from kb.lower.triton_options import LowerOptions

__all__ = ["lower_program", "forward_module", "LowerOptions", "program_signature", "kernel_sources", "check_attention_params", "PREAMBLE"]


def lower_program(p: Program, options: LowerOptions | None = None, designs: DesignTable | None = None,
                  cuda: CudaDispatch | None = None) -> str:
    """The source text of a standalone Python module running `p` with Triton.

    `designs` ({arch: {head-dim bucket: designs best first}}) are the launch parameters the module picks from on a
    GPU; without them (or for a GPU they miss) it times what it has once per shape, including the program's schedule.
    A forward module ends with its operator section (kb.lower.triton_op: `torch.ops.kernel_kb.<OP_NAME>`,
    `kb_attention`), forward-only: its backward raises NO_BACKWARD. `cuda`: where its forward runs the `.cu` beside it
    instead (kb.lower.cuda_dispatch)."""
    if is_backward(p):
        return lower_backward(p, options or LowerOptions(), designs)
    text = forward_module(p, options, designs, cuda)
    return text + op_section(p, text, cuda=bool(cuda))
