"""Honest kernels pass; user mistakes raise KBError; crashes and hangs are verdicts; CLI and units."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kb.errors import KBError
from verify import Verdict, VerifyOptions, VerifyResult, verify
from verify.cli import verify_command
from verify.timing import attention_flops, composite_score, perf_term, roofline_ms

FIX = Path(__file__).parent / "support" / "verify_fixtures"
SPEC = FIX / "attn_spec.py"
FAST = dict(distributions=("normal", "adversarial"), max_cases=2, timeout_s=300)


def test_triton_flash_attention_passes_fp32() -> None:
    r = verify(SPEC, FIX / "triton_flash.py", VerifyOptions(**FAST))
    assert r.verdict is Verdict.passed, r.message
    assert r.calls >= 4 and r.max_abs_err < 1e-4 and r.seed >= 0
    assert any(c.Sq == 37 for c in r.cases), "a ragged length must be tested"
    assert r.timing is not None and not r.timing.timed and "not timed" in r.timing.reason


def test_triton_flash_attention_passes_bf16_gqa_causal() -> None:
    opts = VerifyOptions(distributions=("large",), max_cases=2, timeout_s=300)
    r = verify(FIX / "gqa_causal_bf16_spec.py", FIX / "triton_flash.py", opts)
    assert r.verdict is Verdict.passed, r.message
    assert all(c.dtype == "bfloat16" for c in r.cases)


def test_torch_reimplementation_needs_baseline_mode() -> None:
    strict = verify(SPEC, FIX / "torch_reference.py", VerifyOptions(**FAST))
    assert strict.verdict is Verdict.forbidden_call
    baseline = verify(SPEC, FIX / "torch_reference.py", VerifyOptions(torch_baseline=True, **FAST))
    assert baseline.verdict is Verdict.passed, baseline.message


def test_spec_without_model_is_a_user_error() -> None:
    with pytest.raises(KBError, match="lacks Model"):
        verify(FIX / "spec_without_model.py", FIX / "torch_reference.py", VerifyOptions(**FAST))


def test_signature_mismatch_is_a_user_error() -> None:
    with pytest.raises(KBError, match="does not match Model.forward"):
        verify(SPEC, FIX / "wrong_signature.py", VerifyOptions(**FAST))


def test_candidate_that_does_not_import_is_compile_error() -> None:
    r = verify(SPEC, FIX / "does_not_import.py", VerifyOptions(**FAST))
    assert r.verdict is Verdict.compile_error and "my_missing_cuda_extension" in r.message


def test_hang_is_timeout_and_segfault_is_runtime_error() -> None:
    r = verify(SPEC, FIX / "hangs.py", VerifyOptions(**{**FAST, "timeout_s": 12}))  # the call starts within seconds
    assert r.verdict is Verdict.timeout and "in flight" in r.message
    r = verify(SPEC, FIX / "segfaults.py", VerifyOptions(**FAST))
    assert r.verdict is Verdict.runtime_error and "SIGSEGV" in r.message


def test_extra_inputs_without_get_inputs_for_only_vary_batch() -> None:
    r = verify(FIX / "bias_spec.py", FIX / "torch_reference_bias.py", VerifyOptions(torch_baseline=True, **FAST))
    assert r.verdict is Verdict.passed, r.message
    assert any("only the spec's own shapes plus batch variation" in n for n in r.notes)
    assert {c.Sq for c in r.cases} == {16}


def test_cli_writes_json_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    code = verify_command(SPEC, Path(__file__).parent / "cheats" / "calls_sdpa.py", out, as_json=True, torch_baseline=False)
    assert code == 1
    report = VerifyResult.from_json(out.read_text())
    assert report.verdict is Verdict.forbidden_call and report.finding and report.finding.op
    assert json.loads(capsys.readouterr().out)["verdict"] == "forbidden_call"
    with pytest.raises(KBError):
        verify_command(tmp_path / "nope.py", SPEC, None, as_json=False, torch_baseline=False)


def test_score_formulas() -> None:
    assert perf_term(2.0, 2.0, 1.0) == pytest.approx(0.5)
    assert perf_term(1.0, 2.0, 1.0) == pytest.approx(1.0)
    assert composite_score(True, True, 0.5) == pytest.approx(0.75)
    assert composite_score(True, False, 0.9) == pytest.approx(0.2)
    flops = attention_flops(1, 1, 1024, 1024, 128)
    assert roofline_ms(flops, 0.0, 1000.0, 1.0) == pytest.approx(flops / 1e15 * 1e3)


def test_a_kernel_that_ignores_a_learned_parameter_is_caught_when_it_is_redrawn() -> None:
    opts = VerifyOptions(torch_baseline=True, distributions=("normal",), max_cases=1, timeout_s=300)
    honest = verify(FIX / "sink_spec.py", FIX / "sink_torch.py", opts)
    assert honest.verdict is Verdict.passed, honest.message
    assert any("learned parameters redrawn as N(0, 3): sinks" in n for n in honest.notes)
    cheat = verify(FIX / "sink_spec.py", FIX / "sink_ignored.py", opts)
    assert cheat.verdict is Verdict.numeric_mismatch, cheat.message
    assert cheat.calls == honest.calls  # every call at the spec's own sinks passed: only the redrawn one fails
