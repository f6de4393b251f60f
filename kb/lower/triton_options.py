"""The options of the Triton lowering (kb.lower.triton): speed transformations, each keeping the IR's meaning."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LowerOptions"]


@dataclass(frozen=True)
class LowerOptions:
    """Speed transformations of the lowering; each keeps the IR's semantics exactly.

    - split_kv_loop: a forward KV loop whose masks/block-class tests all concern the loop's own
      (BLOCK_M x BLOCK_N) tile, under a closed-form plan (no mask, or bounds on q_idx - kv_idx),
      becomes three loops: partial blocks, full blocks (no mask code, unmasked K/V loads), partial
      blocks. Full blocks form one interval of kv_start, computed in closed form per program.
    - fold_scale: `s = s * c` (c a positive scalar param, checked on the host) followed only by
      masks and online_softmax is folded into the softmax's exp2 argument (one FMA per score). Forward only: the
      same fold in the backward (and dS's scale deferred to the accumulators) measured no faster (run 18).
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
    - time_designs: on a GPU its design table lists, the module times the listed designs that fit once per shape
      bucket and runs the fastest (TIME_DESIGNS, BWD_TIME_DESIGNS); off, it runs the first that fits. Off for
      `kb generate --deterministic`: which design runs must not depend on a timing.
    """

    split_kv_loop: bool = True
    fold_scale: bool = True
    even_headdim: bool = True
    heavy_first: bool = True
    tma: bool = True
    warp_specialize: bool = False
    indexed_kv_loop: bool = True
    pack_gqa: bool = True
    time_designs: bool = True
