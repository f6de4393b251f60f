"""The cheating-kernel catalogue: every file in tests/cheats/ gets its expected non-passing verdict."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from verify import Verdict, VerifyOptions, VerifyResult, verify

HERE = Path(__file__).parent
SPEC = HERE / "support" / "verify_fixtures" / "attn_spec.py"
CHEATS = HERE / "cheats"

# cheat file -> (expected verdict, run in torch-baseline mode?). Baseline mode lets cheats use
# torch math for their "honest" part, so the verdict is caused by the hack itself.
EXPECTED: dict[str, tuple[Verdict, bool]] = {
    "calls_sdpa": (Verdict.forbidden_call, False),
    "calls_sdpa_hidden": (Verdict.forbidden_call, False),
    "custom_op_hidden": (Verdict.forbidden_call, False),
    "opaque_op": (Verdict.forbidden_call, False),
    "matmul_softmax": (Verdict.forbidden_call, False),
    "emulated_matmul": (Verdict.forbidden_call, False),
    "scores_in_scratch": (Verdict.forbidden_call, False),
    "cache_by_data_ptr": (Verdict.hack_suspected, True),
    "cache_by_shape": (Verdict.hack_suspected, True),
    "copies_input": (Verdict.hack_suspected, False),
    "zeros_on_constant": (Verdict.numeric_mismatch, True),
    "exact_shape_only": (Verdict.runtime_error, True),
    "low_precision": (Verdict.numeric_mismatch, True),
    "partial_output": (Verdict.numeric_mismatch, True),
    "stale_memory": (Verdict.numeric_mismatch, True),
    "side_stream": (Verdict.hack_suspected, True),
    "try_except_fallback": (Verdict.hack_suspected, False),
    "lazy_subclass": (Verdict.hack_suspected, True),
    "background_thread": (Verdict.hack_suspected, True),
    "nondeterministic": (Verdict.nondeterministic, True),
    "calls_reference_module": (Verdict.hack_suspected, True),
}
GPU_ONLY = {"side_stream"}


def test_catalogue_is_complete() -> None:
    files = {p.stem for p in CHEATS.glob("*.py") if not p.stem.startswith(("_", "bwd_"))}  # bwd_: test_verify_backward
    assert files == set(EXPECTED), "every cheat file needs an expected verdict, and vice versa"
    assert len(files) >= 12


def _run(name: str) -> VerifyResult:
    opts = VerifyOptions(torch_baseline=EXPECTED[name][1], distributions=("normal", "adversarial"), max_cases=2,
                         timeout_s=400)
    return verify(SPEC, CHEATS / f"{name}.py", opts)


@pytest.fixture(scope="module")
def catalogue() -> dict[str, VerifyResult]:
    """All CPU cheats verified at once: each is its own child process, so threads overlap their startup."""
    names = sorted(set(EXPECTED) - GPU_ONLY)
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(names, pool.map(_run, names)))


@pytest.mark.parametrize("name", sorted(set(EXPECTED) - GPU_ONLY))
def test_cheat_is_caught(name: str, catalogue: dict[str, VerifyResult]) -> None:
    verdict = EXPECTED[name][0]
    result = catalogue[name]
    assert result.verdict is verdict, f"{name}: {result.verdict.value}: {result.message}"
    assert not result.passed and result.finding is not None and result.finding.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="side-stream work only exists on a CUDA device")
@pytest.mark.parametrize("name", sorted(GPU_ONLY))
def test_gpu_cheat_is_caught(name: str) -> None:
    verdict, baseline = EXPECTED[name]
    opts = VerifyOptions(torch_baseline=baseline, distributions=("normal",), max_cases=2, timeout_s=240)
    assert verify(SPEC, CHEATS / f"{name}.py", opts).verdict is verdict
