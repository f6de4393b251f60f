"""A generated forward module that dispatches to the `.cu` beside it: where it runs the `.cu`, the build at first use
(real nvcc, cached by content), and the Triton kernels wherever the `.cu` cannot run (no GPU here, no nvcc, a failed
build), with one warning saying why."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # the modules run their Triton kernels here; set before triton is imported

import ctypes
import logging
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from generate.cuda_design import CudaPair, CudaPlan, choose_cuda
from generate.pipeline import GenerateOptions, _dispatch
from generate.spec import load_spec
from kb.features import Features
from kb.ir.nodes import Dtype
from kb.lower.cuda import launch_abi
from kb.lower.cuda_build import find_nvcc
from kb.lower.cuda_dispatch import CudaDispatch
from kb.lower.cuda_mma import MmaTraits
from kb.lower.runtime import import_file
from kb.lower.triton import lower_program
from kb.lower import nvcc_preamble
from kb.lower.cuda_sm90_ir import lower_program_sm90
from kb.lower.triton_bwd import lower_autograd
from tests.support.ir_programs import FIXTURES, causal_bwd
from tests.support.repo import REPO

WHY = "the `.cu` runs: measured 1.12x the Triton module (this kernel)"
TINY_CU = 'extern "C" int kb_launch(void**, long long*, long long*, double*, void*) { return 7; }\n' \
          'extern "C" const char* kb_error_string(int code) { return code == 7 ? "tiny" : "head dim differs"; }\n'


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A bf16 causal module dispatching to its Hopper `.cu` at head dim 64 on sm90, and the same module without."""
    out = tmp_path_factory.mktemp("dispatch")
    p = FIXTURES["causal"](Dtype.BF16)
    cu = choose_cuda(p, CudaPlan("sm90", 64, MmaTraits(128, 64, 4), "test"))
    assert cu is not None and cu.lowering == "sm90_wgmma"
    (out / "gen_causal.cu").write_text(cu.source)
    dispatch = CudaDispatch("gen_causal.cu", cu.source, cu.arch, {"sm90": {64: WHY}})
    (out / "gen_causal.py").write_text(lower_program(p, cuda=dispatch))
    (out / "plain.py").write_text(lower_program(p))
    return out / "gen_causal.py", out / "plain.py"


def test_the_module_says_where_it_runs_the_cu_and_in_which_launch_order(written) -> None:
    with_cu, without = written
    mod = import_file(with_cu, "kb_dispatch_with_cu")
    assert mod.CUDA_SOURCE == "gen_causal.cu" and mod.CUDA_ARCH == "sm_90a" and mod.CUDA_FORWARD == {"sm90": {64: WHY}}
    abi = launch_abi(FIXTURES["causal"](Dtype.BF16))
    assert [t[0] for t in mod._CUDA_ABI["tensors"]] == [t.name for t in abi.tensors]
    assert mod._CUDA_ABI["dims"] == abi.dims and mod._CUDA_ABI["scalars"] == abi.scalars
    assert "CUDA_FORWARD" not in without.read_text() and "_cuda_forward" not in without.read_text()


def test_where_the_cu_cannot_run_the_triton_kernels_give_the_same_answer(written) -> None:
    with_cu, without = written
    a, b = import_file(with_cu, "kb_dispatch_with_cu"), import_file(without, "kb_dispatch_without")
    q, k, v = (torch.randn(1, 2, 40, 64).to(torch.bfloat16) for _ in range(3))
    assert a._cuda_forward(q, k, v, None, {}) is None  # CPU tensors
    torch.testing.assert_close(a.kb_attention(q, k, v), b.kb_attention(q, k, v), rtol=0, atol=0)
    with torch.no_grad():  # through the inference operator
        torch.testing.assert_close(a._OP_INFER(q, k, v, None)[0], b.kb_attention(q, k, v), rtol=0, atol=0)


def test_without_nvcc_the_module_warns_once_and_runs_triton(written, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    mod = import_file(written[0], "kb_dispatch_no_nvcc")
    monkeypatch.setattr(mod, "_find_nvcc", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100/H200
    device = torch.device("cuda", 0)  # the library is looked up per device; no GPU is touched before the build
    with caplog.at_level(logging.WARNING, logger="kernel_kb.generated"):
        assert mod._cuda_library(device, 64) is None and mod._cuda_library(device, 64) is None
    (record,) = caplog.records
    assert "running the Triton kernels instead of gen_causal.cu: nvcc was not found" in record.getMessage()


def test_an_sm90a_cu_runs_on_hopper_only_and_a_family_cu_on_newer_gpus_too(written) -> None:
    mod = import_file(written[0], "kb_dispatch_with_cu")
    assert mod._cuda_build_arch(9, 0) == "sm_90a" and mod._cuda_build_arch(10, 0) is None
    assert mod._cuda_build_arch(8, 0) is None
    mod.CUDA_ARCH = "sm_80"  # a tensor-core or portable `.cu`: built for the GPU it runs on
    try:
        assert mod._cuda_build_arch(9, 0) == "sm_90" and mod._cuda_build_arch(8, 6) == "sm_86"
        assert mod._cuda_build_arch(7, 5) is None
    finally:
        mod.CUDA_ARCH = "sm_90a"


def test_the_cu_is_built_once_and_cached_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    find_nvcc()  # nvcc is part of the test machine (CUDA C++ is compiled in CI)
    monkeypatch.setenv("KB_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "tiny.cu"
    src.write_text(TINY_CU)
    lib = nvcc_preamble._cuda_build(str(src), "sm_80")
    assert Path(lib).parent == tmp_path / "cache" / "cuda" and Path(lib).is_file()

    def no_nvcc(*args, **kwargs):
        raise AssertionError("nvcc ran again for a cached build")

    monkeypatch.setattr(subprocess, "run", no_nvcc)
    assert nvcc_preamble._cuda_build(str(src), "sm_80") == lib
    src.write_text(TINY_CU + "// changed\n")
    with pytest.raises(AssertionError, match="ran again"):
        nvcc_preamble._cuda_build(str(src), "sm_80")


def test_a_launch_the_cu_refuses_runs_triton_and_a_cuda_error_raises(written, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KB_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "tiny.cu"
    src.write_text(TINY_CU)
    lib = ctypes.CDLL(nvcc_preamble._cuda_build(str(src), "sm_80"))
    lib.kb_error_string.restype = ctypes.c_char_p
    mod = import_file(written[0], "kb_dispatch_with_cu")
    assert mod._cuda_launched(lib, 0)
    with caplog.at_level(logging.WARNING, logger="kernel_kb.generated"):
        assert not mod._cuda_launched(lib, 10001) and not mod._cuda_launched(lib, -1)  # the .cu's own checks
    (record,) = caplog.records  # one warning per reason
    assert "refused these inputs (head dim differs); running the Triton kernels" in record.getMessage()
    with pytest.raises(RuntimeError, match=r"the CUDA launch of gen_causal.cu failed: tiny \(code 7\)"):
        mod._cuda_launched(lib, 7)  # a CUDA error


def test_an_nvcc_error_is_one_line_saying_what_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KB_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "broken.cu"
    src.write_text("this is not C++\n")
    with pytest.raises(nvcc_preamble._CudaUnavailable, match=r"nvcc could not build .*broken\.cu: .*error") as err:
        nvcc_preamble._cuda_build(str(src), "sm_80")
    assert "\n" not in str(err.value)
    assert not list((tmp_path / "cache" / "cuda").glob("*.so")) and not list((tmp_path / "cache" / "cuda").glob("*.tmp"))


def test_generation_writes_the_dispatch_only_where_a_measurement_says_the_cu_is_faster() -> None:
    spec = load_spec(REPO / "bench" / "tuning" / "causal.py")  # bf16, D=64
    program = FIXTURES["causal"](Dtype.BF16)
    plan = CudaPlan("sm90", 64, MmaTraits(128, 64, 4), "test")
    cu = choose_cuda(program, plan)
    assert cu is not None and cu.lowering == "sm90_wgmma"
    pair = CudaPair("k-elsewhere", Features(mask="causal", dtype="bf16"), "NVIDIA H200", {"D": 64, "B": 1}, "2026-12-05",
                    triton_ms=1.2, cuda_ms=1.0)
    options = GenerateOptions(cuda_pairs={"sm90_wgmma": [pair]})
    dispatch, runs = _dispatch(spec, program, cu, plan, options)
    assert dispatch is not None and dispatch.source_name == "gen_causal.cu" and list(dispatch.forward) == ["sm90"]
    assert runs.startswith("the `.cu` runs: measured 1.20x the Triton module") and runs.endswith("(on sm90, head dim 64)")
    slower = replace(pair, cuda_ms=1.5)
    for pairs in ({"sm90_wgmma": [slower]}, {"tensor_cores": [pair]}, {}):  # slower, another lowering, none measured
        dispatch, runs = _dispatch(spec, program, cu, plan, replace(options, cuda_pairs=pairs))
        assert not dispatch and runs.startswith("the Triton module runs")  # it carries the `.cu`, listing nothing


def test_a_module_whose_cu_holds_the_hopper_backward_tries_it_first_where_listed(tmp_path: Path) -> None:
    fwd, bwd = FIXTURES["causal"](Dtype.BF16), causal_bwd(Dtype.BF16)
    src = lower_program_sm90(fwd, 64, backward=True)
    (tmp_path / "gen_causal.cu").write_text(src)
    listed = CudaDispatch("gen_causal.cu", src, "sm_90a", {}, {"sm90": {64: WHY}}, has_backward=True)
    (tmp_path / "gen_causal.py").write_text(lower_autograd(fwd, bwd, cuda=listed))
    mod = import_file(tmp_path / "gen_causal.py", "kb_test_dispatch_bwd")
    assert mod.CUDA_BACKWARD == {"sm90": {64: WHY}} and mod.CUDA_FORWARD == {} and mod.CUDA_BWD_PAD_Q == 128
    body = _op_backward_body((tmp_path / "gen_causal.py").read_text())
    assert "_cuda_backward(q, k, v, o, dout, lse, sm_scale" in body and "backward(q, k, v, o, dout, lse" in body
    q, k, v = (torch.randn(1, 2, 40, 64, dtype=torch.bfloat16) for _ in range(3))
    o, lse = mod.forward(q, k, v)
    assert mod._cuda_backward(q, k, v, o, torch.ones_like(o), lse, None, {}) is None  # CPU tensors: backward() runs
    q.requires_grad_(True)
    mod.kb_attention(q, k, v).float().sum().backward()  # through the operator: the Triton backward, interpreted
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()
    unlisted = CudaDispatch("gen_causal.cu", src, "sm_90a", {}, {}, has_backward=True)
    assert "_cuda_backward(" in _op_backward_body(lower_autograd(fwd, bwd, cuda=unlisted))  # listed once measured faster
    forward_only = CudaDispatch("gen_causal.cu", lower_program_sm90(fwd, 64), "sm_90a", {"sm90": {64: WHY}})
    assert "_cuda_backward(" not in _op_backward_body(lower_autograd(fwd, bwd, cuda=forward_only))


def _op_backward_body(module_text: str) -> str:
    return module_text.split("def _op_backward(", 1)[1].split("\ndef ", 1)[0]
