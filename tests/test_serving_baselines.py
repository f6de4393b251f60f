"""The baselines timed beside generated serving kernels (bench/gpu/serving_baselines.py) compute what each held-out
serving spec computes, on its own inputs: vLLM 0.33.0's unified_attention, imported from the pinned wheel's source
and run by Triton's interpreter, and FlexAttention (eager here) over the physical paged cache or the packed batch.
In fp32 both match the Model to rounding, so a window or prefix one key off, a wrong ALiBi sign or a lost sink fails."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below (vLLM's kernel runs on CPU)

from functools import lru_cache
from pathlib import Path

import pytest
import torch

import kb.lower.triton_preamble  # noqa: F401  # its interpreter fixes apply on import (bf16 tl.dot read as raw bits)
from bench.gpu.serving_baselines import baselines
from bench.gpu.serving_flashinfer import _csr
from ingest.fetch import fetch
from ingest.manifest import find_manifest
from kb.lower.runtime import import_file
from tests.support.repo import REPO, TEST_CACHE

pytestmark = pytest.mark.network  # the pinned vLLM wheel, downloaded once into .kb-test-cache

HELDOUT = REPO / "bench" / "heldout_serving"
SPECS = ("paged_decode_window_sinks", "paged_gqa_decode_alibi", "varlen_prefill_softcap", "chunked_prefill_prefix_lm")


@lru_cache(maxsize=None)
def _vllm_root() -> Path:
    return fetch(find_manifest("vllm")).root


@pytest.fixture
def vllm_src(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KB_CACHE_DIR", str(TEST_CACHE))  # function-scoped: conftest clears KB_* before every test
    return _vllm_root()


# the interpreter divides the rows past a sequence's last query by their zero sum (never stored); eager Flex warns
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
# fp32: both baselines match the Model to rounding (1e-4), so the check is tight; bf16 adds nothing but tolerance
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4)], ids=["fp32"])
@pytest.mark.parametrize("name", SPECS)
def test_each_baseline_computes_the_spec(name: str, dtype: torch.dtype, tol: float, vllm_src: Path) -> None:
    spec = import_file(HELDOUT / f"{name}.py", f"spec_{name}")
    inputs = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in spec.get_inputs()]
    model = spec.Model(*spec.get_init_inputs())
    with torch.no_grad():
        want = model(*inputs)
        fns = baselines(spec, model, inputs, vllm_src, compile=False)
        assert set(fns) == {"vllm_unified", "flex_paged", "flashinfer"}
        assert fns["flashinfer"][0] is None and "flashinfer" in fns["flashinfer"][1]  # a GPU library: not run here
        for key, (fn, note) in fns.items():
            if key == "flashinfer":
                continue
            assert fn is not None, f"{key}: {note}"
            for _ in range(2):  # a second call (vLLM's writes into the same buffer) gives the same output
                got = fn()
                assert (got.shape, got.dtype) == (want.shape, want.dtype), key
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"{key}: {m}")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_without_a_vllm_source_only_flex_runs() -> None:
    spec = import_file(HELDOUT / "paged_gqa_decode_alibi.py", "spec_paged_gqa_decode_alibi")
    fns = baselines(spec, spec.Model(), spec.get_inputs(), None, compile=False)
    assert fns["vllm_unified"] == (None, "no vLLM source given (--vllm-src)")
    assert fns["flex_paged"][0] is not None


def test_flashinfer_page_arrays_follow_the_block_table() -> None:
    """FlashInfer reads a paged cache as CSR arrays: sequence b's pages are indices[indptr[b]:indptr[b + 1]], its
    last page holds last_page_len keys; an empty sequence has no pages (the block table's unused columns are dropped)."""
    table = torch.tensor([[7, 3, 9], [4, 8, 2], [5, 6, 1]], dtype=torch.int32)
    indptr, indices, last = _csr(table, torch.tensor([17, 0, 48], dtype=torch.int32), page=16)
    assert indptr.tolist() == [0, 2, 2, 5] and indices.tolist() == [7, 3, 5, 6, 1] and last.tolist() == [1, 0, 16]
