"""A split-KV program run with one split stores its outputs from the split kernel and skips the combine
(kb.lower.split_direct): same o and lse as with the combine, bit for bit, and the combine is not launched."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import dataclasses
from pathlib import Path

import pytest
import torch

from kb.ir.nodes import Elementwise, Kernel, Program, Store
from kb.lower.runtime import TritonKernel
from kb.lower.split_direct import direct_outputs
from kb.lower.triton import lower_program
from kb.lower.triton_host import kernel_fn_name
from tests.support.attn_reference import reference_attention
from tests.support.ir_programs import E, decode_split_kv


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("triton_cache")


def _inputs(N: int) -> dict:
    g = torch.Generator().manual_seed(7)
    B, H, D = 2, 3, 16
    return {"q": torch.randn(B, H, 1, D, generator=g), "k": torch.randn(B, H, N, D, generator=g),
            "v": torch.randn(B, H, N, D, generator=g), "sm_scale": 0.25}


def test_a_plain_combine_is_skipped_at_one_split() -> None:
    p = decode_split_kv(num_splits=1)
    direct = direct_outputs(p)
    assert direct is not None and direct.combine == "combine"
    assert direct.outputs == {"o_part": ("o", 2), "lse_part": ("lse", 2)}  # [B, H, NUM_SPLITS, M(, D)]
    src = lower_program(p)
    assert "ONE_SPLIT = NUM_SPLITS == 1" in src and "if not ONE_SPLIT:" in src
    assert "if ONE_SPLIT:  # one split: the partial is o itself" in src


def _with_combine_body(p: Program, body: tuple) -> Program:
    kernels = tuple(dataclasses.replace(k, body=body) if k.name == "combine" else k for k in p.kernels)
    return dataclasses.replace(p, kernels=kernels)


def test_a_combine_that_does_more_than_merge_is_always_launched() -> None:
    p = decode_split_kv(num_splits=1)
    combine = next(k for k in p.kernels if k.name == "combine")
    # o scaled after the merge: the partial is no longer the output
    scaled = tuple(st for st in combine.body if not isinstance(st, Store)) + (
        Elementwise("ot2", E("ot * 2.0")),
        *(dataclasses.replace(st, value="ot2") if st.tensor == "o" else st
          for st in combine.body if isinstance(st, Store)))
    assert direct_outputs(_with_combine_body(p, scaled)) is None
    assert "ONE_SPLIT" not in lower_program(_with_combine_body(p, scaled))


def test_a_partial_added_to_is_not_an_output() -> None:
    p = decode_split_kv(num_splits=1)
    kernels = tuple(dataclasses.replace(k, body=tuple(
        dataclasses.replace(st, accumulate=True) if isinstance(st, Store) and st.tensor == "o_part" else st
        for st in k.body)) if k.name == "split" else k for k in p.kernels)
    assert direct_outputs(dataclasses.replace(p, kernels=kernels)) is None


@pytest.mark.parametrize("N", [45, 7])  # seven keys: fewer than one block per split at three splits
def test_one_split_stores_what_the_combine_would(N: int, cache_dir: Path) -> None:
    inputs = _inputs(N)
    one = TritonKernel.from_program(decode_split_kv(num_splits=1), cache_dir)
    launched: list[str] = []
    for k in one.program.kernels:  # count launches by kernel: the combine's must not happen
        fn = getattr(one.module, kernel_fn_name(k))
        setattr(one.module, kernel_fn_name(k), _Counting(fn, k, launched))
    got = one.run(inputs)
    assert launched == ["split"]
    three = TritonKernel.from_program(decode_split_kv(num_splits=3), cache_dir).run(inputs)
    o_ref, lse_ref = reference_attention(one.program, inputs["q"], inputs["k"], inputs["v"], scalars={"sm_scale": 0.25})
    torch.testing.assert_close(got["o"], o_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got["lse"], lse_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got["o"], three["o"], atol=2e-5, rtol=2e-5)


class _Counting:
    """A `@triton.jit` function whose launches are listed by IR kernel name."""

    def __init__(self, fn: object, kernel: Kernel, launched: list[str]) -> None:
        self.fn, self.kernel, self.launched = fn, kernel, launched

    def __getitem__(self, grid: object) -> object:
        self.launched.append(self.kernel.name)
        return self.fn[grid]  # type: ignore[index]
