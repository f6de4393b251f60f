"""bench.relower_triton: a generated module's kernels swapped for another lowering's, host code untouched."""

from __future__ import annotations

import pytest

from bench.relower_triton import jit_blocks, relower_module
from kb.lower.triton import LowerOptions, lower_program
from tests.support.ir_programs import FIXTURES, causal_bwd


def test_a_module_relowered_by_the_same_lowering_is_unchanged() -> None:
    src = lower_program(FIXTURES["causal"]())
    assert [name for name, _, _ in jit_blocks(src)] == ["_fwd_kv_block", "_fwd_kernel"]  # the preamble's are left out
    assert relower_module(src, [src]) == src


def test_kernels_come_from_the_other_lowering_with_their_helpers_and_the_host_code_stays() -> None:
    split = lower_program(FIXTURES["causal"]())
    plain = lower_program(FIXTURES["causal"](), LowerOptions(split_kv_loop=False))
    assert "_fwd_kv_block" not in plain
    swapped = relower_module(plain, [split])
    assert "def _fwd_kv_block(" in swapped and swapped.count("_fwd_kv_block(n_start") == 3
    host = plain[plain.index("def _fwd_kernel("):].split("\n\n\n", 1)[1]  # what follows the kernel
    assert swapped.endswith(host)
    with pytest.raises(KeyError, match="_fwd_kernel"):
        relower_module(plain, [lower_program(causal_bwd())])
