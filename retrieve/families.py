"""Label families: the coarse reference families the labelled spec set is written against.

A kernel row's `family` is its lifter's name for where it came from (`fa2_triton`,
`fa2_triton_amd`, `fa2_cuda`, `fa4_cute`, `cutlass_fmha_sm90`, ...). The labelled specs
(tests/data/specs, `LABEL["family"]`) name the reference a transfer should start from in
coarser terms. `label_family` maps one onto the other through one explicit table.

Invariant: every ingest family in `corpus/*.toml` appears in `FAMILY_TABLE`; the decode
split only matters for FlashAttention's Triton families, whose one source file holds both forward
and split-KV decode programs. The serving kernels of vLLM and SGLang (packed sequences, paged KV)
are their own label family: no labelled spec is written against them yet.
"""

from __future__ import annotations

from kb.features import Features

__all__ = ["LABEL_FAMILIES", "FAMILY_TABLE", "label_family"]

LABEL_FAMILIES = ("triton_fwd", "triton_decode", "fa2_cuda", "cute_fa4", "cutlass_fmha", "serving_triton", "generated")

# kernel family -> (label when forward, label when split-KV/decode)
FAMILY_TABLE: dict[str, tuple[str, str]] = {
    "fa2_triton": ("triton_fwd", "triton_decode"),
    "fa2_triton_amd": ("triton_fwd", "triton_decode"),
    # serving kernels (packed varlen, paged KV): a reference for serving specs, never a hit for a dense one
    "vllm_triton": ("serving_triton", "serving_triton"),
    "sglang_triton": ("serving_triton", "serving_triton"),
    "fa2_cuda": ("fa2_cuda", "fa2_cuda"),
    "fa4_cute": ("cute_fa4", "cute_fa4"),
    "cutlass_cute_sm80": ("cutlass_fmha", "cutlass_fmha"),
    "cutlass_fmha_sm80": ("cutlass_fmha", "cutlass_fmha"),
    "cutlass_fmha_sm90": ("cutlass_fmha", "cutlass_fmha"),
    "cutlass_fmha_sm100": ("cutlass_fmha", "cutlass_fmha"),
    "generated": ("generated", "generated"),
}


def label_family(kernel_family: str, features: Features) -> str:
    """The label family of a kernel row; an unknown kernel family maps to itself."""
    fwd, dec = FAMILY_TABLE.get(kernel_family, (kernel_family, kernel_family))
    return dec if (features.split_kv or features.decode) else fwd
