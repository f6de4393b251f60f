"""Gradient verification (`backward=True`, `kb verify --backward`): honest backward kernels pass, every
backward cheat in tests/cheats/bwd_*.py gets its verdict, and the guard's and static scan's backward rules."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from verify import Verdict, VerifyOptions, VerifyResult, verify
from verify.checks import TOLERANCES
from verify.cli import verify_command
from verify.grads import GRAD_SLACK, DtypeEmulation, compare_grad
from verify.guard import CallGuard
from verify.static import scan_candidate

HERE = Path(__file__).parent
FIX = HERE / "support" / "verify_fixtures"
CHEATS = HERE / "cheats"
SPEC = FIX / "bwd_attn_spec.py"  # causal fp32, B1 H2 S24 D16
BF16_SPEC = FIX / "gqa_causal_bf16_spec.py"
BIAS_SPEC = FIX / "rel_bias_spec.py"  # a learnable nn.Parameter table
FP32_OUT_SPEC = FIX / "bf16_in_fp32_out_spec.py"
FAST = dict(backward=True, distributions=("normal",), max_cases=2, timeout_s=300)

# cheat -> (spec, torch-baseline mode?, expected verdict, expected op or None, gradient at fault or None)
BWD_EXPECTED: dict[str, tuple[Path, bool, Verdict, str | None, str | None]] = {
    "bwd_autograd_recompute": (SPEC, False, Verdict.forbidden_call, "autograd", None),
    "bwd_autograd_recompute_hidden": (SPEC, False, Verdict.forbidden_call, "autograd_in_backward", None),
    "bwd_hidden_matmul": (SPEC, False, Verdict.forbidden_call, "aten.bmm.default", None),
    "bwd_cached_grads": (SPEC, False, Verdict.hack_suspected, "cached_grad", "q"),
    "bwd_reused_buffer": (SPEC, False, Verdict.hack_suspected, "reused_grad_buffer", "q"),
    "bwd_zero_dk": (SPEC, False, Verdict.numeric_mismatch, None, "k"),
    "bwd_partial_dq": (SPEC, False, Verdict.numeric_mismatch, None, "q"),
    "bwd_detached": (SPEC, False, Verdict.no_backward, None, None),
    "bwd_not_implemented": (SPEC, False, Verdict.no_backward, None, None),
    "bwd_param_detached": (BIAS_SPEC, True, Verdict.no_backward, None, "param rel_bias"),
}

# every child process of this file, started together (each is its own process; threads overlap them)
RUNS: dict[str, tuple[Path, Path, VerifyOptions]] = {
    "honest_fp32": (SPEC, FIX / "triton_flash_bwd.py", VerifyOptions(**{**FAST, "distributions": ("normal", "adversarial")})),
    "honest_bf16_gqa": (BF16_SPEC, FIX / "triton_flash_bwd.py", VerifyOptions(**{**FAST, "distributions": ("large",)})),
    "honest_param": (BIAS_SPEC, FIX / "torch_rel_bias.py", VerifyOptions(**{**FAST, "torch_baseline": True})),
    "honest_fp32_out": (FP32_OUT_SPEC, FIX / "torch_fp32_out.py", VerifyOptions(**{**FAST, "torch_baseline": True})),
    "detached_forward_only": (SPEC, CHEATS / "bwd_detached.py", VerifyOptions(**{**FAST, "backward": False})),
    **{name: (spec, CHEATS / f"{name}.py", VerifyOptions(**{**FAST, "torch_baseline": baseline}))
       for name, (spec, baseline, *_rest) in BWD_EXPECTED.items()},
}


@pytest.fixture(scope="module")
def results() -> dict[str, VerifyResult]:
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(RUNS, pool.map(lambda name: verify(*RUNS[name]), RUNS)))


# ---- honest candidates pass
def test_triton_backward_passes_fp32(results: dict[str, VerifyResult]) -> None:
    r = results["honest_fp32"]
    assert r.verdict is Verdict.passed, r.message
    assert r.backward is not None and r.backward.grads == ("q", "k", "v")
    assert r.backward.calls == r.calls >= 4, "every call's output is differentiated"
    # fp32: the reference is the Model in fp64, and fp32 torch's distance from it (the slack) is tiny for q, k, v
    assert r.backward.max_abs_err < 1e-4 and 0.0 < r.backward.max_torch_err < 1e-5
    assert "gradients of q, k, v checked" in r.message


def test_triton_backward_passes_bf16_gqa(results: dict[str, VerifyResult]) -> None:
    r = results["honest_bf16_gqa"]
    assert r.verdict is Verdict.passed, r.message
    assert r.backward is not None and r.backward.max_torch_err > 0, "bf16 tolerance comes from emulated torch rounding"
    assert r.backward.max_abs_err > 0


def test_learnable_parameter_gradient_is_checked(results: dict[str, VerifyResult]) -> None:
    r = results["honest_param"]
    assert r.verdict is Verdict.passed, r.message
    assert r.backward is not None and "param rel_bias" in r.backward.grads


def test_bf16_inputs_with_an_fp32_output_get_bf16_gradients_judged_as_torch_gives_them(
        results: dict[str, VerifyResult]) -> None:
    """The output is fp32, but a bf16 input's gradient is bf16 (torch's too): judged against fp32's tolerance alone,
    no candidate could pass (the held-out fp32-out cross attention was left without a backward)."""
    r = results["honest_fp32_out"]
    assert r.verdict is Verdict.passed, r.message
    assert r.backward is not None and r.backward.grads == ("q", "k", "v")


def test_forward_only_run_does_not_ask_for_gradients(results: dict[str, VerifyResult]) -> None:
    r = results["detached_forward_only"]
    assert r.verdict is Verdict.passed, r.message
    assert r.backward is None


def test_result_round_trips_through_json(results: dict[str, VerifyResult]) -> None:
    for r in (results["honest_fp32"], results["bwd_zero_dk"]):
        assert VerifyResult.from_json(r.to_json()) == r


# ---- the backward cheat catalogue
def test_backward_catalogue_is_complete() -> None:
    files = {p.stem for p in CHEATS.glob("bwd_*.py")}
    assert files == set(BWD_EXPECTED), "every bwd_ cheat file needs an expected verdict, and vice versa"


@pytest.mark.parametrize("name", sorted(BWD_EXPECTED))
def test_backward_cheat_is_caught(name: str, results: dict[str, VerifyResult]) -> None:
    _spec, _baseline, verdict, op, grad = BWD_EXPECTED[name]
    r = results[name]
    assert r.verdict is verdict, f"{name}: {r.verdict.value}: {r.message}"
    f = r.finding
    assert f is not None and f.message and f.phase == "backward"
    if op is not None:
        assert f.op == op, f.message
    if grad is not None:
        assert f.grad == grad, f.message
    if verdict is Verdict.no_backward:
        assert "no backward" in f.message or "no gradient" in f.message


def test_cli_backward_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    code = verify_command(SPEC, CHEATS / "bwd_not_implemented.py", out, as_json=True, torch_baseline=False, backward=True)
    assert code == 1
    assert VerifyResult.from_json(out.read_text()).verdict is Verdict.no_backward
    assert json.loads(capsys.readouterr().out)["finding"]["phase"] == "backward"


# ---- units: guard, static scan, tolerance
class _NestedAutograd(torch.autograd.Function):
    """Backward asks torch autograd for a gradient of a graph recorded earlier (no op under enable_grad)."""

    @staticmethod
    def forward(ctx, x, leaf, graph):
        ctx.leaf, ctx.graph = leaf, graph
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (dleaf,) = torch.autograd.grad(ctx.graph, ctx.leaf, torch.ones_like(ctx.graph))
        return g * 2 + 0 * dleaf.sum(), None, None


def _guarded_grad(strict: bool) -> CallGuard:
    leaf = torch.randn(4, requires_grad=True)
    graph = leaf * 3
    x = torch.randn(4, requires_grad=True)
    out = _NestedAutograd.apply(x, leaf, graph)
    guard = CallGuard(strict, __file__, [x], out.numel(), phase="backward")
    with guard:
        torch.autograd.grad(out, [x], torch.ones(4))
    return guard


def test_nested_autograd_in_backward_is_caught() -> None:
    v = _guarded_grad(strict=True).violation
    assert v is not None and v.verdict is Verdict.forbidden_call and v.op == "nested_autograd"
    assert _guarded_grad(strict=False).violation is None, "torch-baseline mode allows torch autograd"
    assert type(torch.autograd.variable.Variable._execution_engine).__name__ != "_EngineWatch", "engine restored"


def test_static_scan_sees_autograd_only_in_backward_runs(tmp_path: Path) -> None:
    src = tmp_path / "cand.py"
    src.write_text(
        "import torch\nfrom torch.autograd import grad as g\nimport torch.func as tf\n\n"
        "class F(torch.autograd.Function):\n    @staticmethod\n    def backward(ctx, do):\n"
        "        with torch.enable_grad():\n            pass\n        g(1, 2)\n        tf.vjp(None)\n"
        "        torch.autograd.grad(1, 2)\n        do.backward()\n        return do\n")
    found = scan_candidate(src, SPEC, torch_baseline=False, backward=True)
    assert {f.line for f in found} == {8, 10, 11, 12, 13}
    assert {(f.verdict, f.op, f.phase) for f in found} == {(Verdict.forbidden_call, "autograd", "backward")}
    assert scan_candidate(src, SPEC, torch_baseline=False) == []
    assert scan_candidate(src, SPEC, torch_baseline=True, backward=True) == []


def test_dtype_emulation_rounds_every_op_output() -> None:
    x = torch.randn(64, dtype=torch.float32)
    with DtypeEmulation(torch.bfloat16):
        y = x * 1.0001
    assert torch.equal(y, y.bfloat16().float()) and not torch.equal(y, x * 1.0001)
    with DtypeEmulation(torch.bfloat16, truncate=True):
        z = x * 1.0001
    assert bool((z.abs() <= (x * 1.0001).abs()).all()), "truncation rounds toward zero"


def test_gradient_tolerance_rule() -> None:
    ref = torch.randn(8, 8)
    atol, rtol = TOLERANCES[torch.bfloat16]
    e_torch = 0.05
    slack = atol * max(1.0, float(ref.abs().max())) + GRAD_SLACK * e_torch
    assert compare_grad(ref + 0.9 * slack, ref, e_torch, torch.bfloat16).ok
    assert not compare_grad(ref + 1.1 * slack + rtol * ref.abs(), ref, e_torch, torch.bfloat16).ok
    assert not compare_grad(torch.zeros_like(ref), ref, e_torch, torch.bfloat16).ok
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert compare_grad(nan, ref, e_torch, torch.bfloat16).nonfinite == 1
