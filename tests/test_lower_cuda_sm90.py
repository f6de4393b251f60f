"""The Hopper (sm_90a) attention forward template compiles cleanly, without spills, to wgmma + TMA."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kb.lower.cuda_build import BuildMode, arch_flag, build, nvcc_command
from kb.lower.cuda_sm90 import (
    SM90_ARCH, Sm90Config, causal_hooks, plain_hooks, sm90_forward_source,
)
from tests.support.cuda import nvcc_or_skip


HOOKS = {"causal": causal_hooks, "plain": plain_hooks}
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _kernel_spills(log: str) -> list[tuple[int, int]]:
    """(stores, loads) per function in ptxas -v output."""
    return [(int(s), int(l)) for s, l in _SPILL.findall(log)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["causal", "plain"])
def test_sm90_builds_without_spills(tmp_path: Path, head_dim: int, mask: str) -> None:
    nvcc_or_skip()
    src = sm90_forward_source(HOOKS[mask](), head_dim_pad=head_dim, block_m=128, block_n=128)
    res = build(src, tmp_path, BuildMode.SHARED, name=f"sm90_{mask}_{head_dim}", arch=SM90_ARCH,
                extra_flags=("-Xptxas", "-v"))
    assert res.ok, res.log
    assert "-gencode=arch=compute_90a,code=sm_90a" in res.command
    assert "kb_sm90_fwd" in res.log and "Used" in res.log, res.log
    spills = _kernel_spills(res.log)
    assert spills and all(s == (0, 0) for s in spills), res.log
    assert "C7508" not in res.log and "setmaxnreg" not in res.log.lower(), res.log  # setmaxnreg not ignored

    ptx = build(src, tmp_path, BuildMode.PTX, name=f"sm90_{mask}_{head_dim}", arch=SM90_ARCH)
    assert ptx.ok, ptx.log
    text = ptx.artefact.read_text()
    for instr in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier.try_wait",
                  "fence.proxy.async"):
        assert instr in text, instr


@pytest.mark.parametrize(("overlap", "pingpong"), [(False, False), (False, True), (True, False)])
def test_sm90_other_schedules_build(tmp_path: Path, overlap: bool, pingpong: bool) -> None:
    nvcc_or_skip()
    src = sm90_forward_source(causal_hooks(), head_dim_pad=128, block_m=128, block_n=128,
                              overlap=overlap, pingpong=pingpong)
    res = build(src, tmp_path, BuildMode.OBJECT, name="sm90_sched", arch=SM90_ARCH, extra_flags=("-Xptxas", "-v"))
    assert res.ok, res.log
    assert all(s == (0, 0) for s in _kernel_spills(res.log)), res.log


def test_sm90_source_shape() -> None:
    src = sm90_forward_source(plain_hooks(), head_dim_pad=64, block_m=128, block_n=64)
    assert src.count("struct KbArgs {") == 1
    assert 'extern "C" int kb_sm90_launch(const KbArgs* args, void* stream)' in src
    assert 'extern "C" const char* kb_sm90_error_string(int code)' in src
    assert "m64n64k16" in src and "cudaGetDriverEntryPointByVersion" in src
    assert "#include <cute" not in src and "cutlass" not in src.lower()


@pytest.mark.parametrize("bad", [dict(head_dim_pad=96), dict(head_dim_pad=64, block_m=64),
                                 dict(head_dim_pad=64, block_n=72), dict(head_dim_pad=64, dtype="fp8")])
def test_sm90_config_rejects(bad: dict) -> None:
    with pytest.raises(ValueError):
        Sm90Config(**bad).validate()


def test_build_arch_flags_keep_old_behaviour(tmp_path: Path) -> None:
    assert arch_flag("sm_90") == "-arch=sm_90"
    assert arch_flag("sm_90a") == "-gencode=arch=compute_90a,code=sm_90a"
    cmd = nvcc_command(tmp_path / "a.cu", tmp_path / "a.o", BuildMode.OBJECT, nvcc="nvcc")
    assert cmd == ["nvcc", "-std=c++17", "-arch=sm_90", "-O3", "--compiler-options", "-fPIC", "-c", "-o",
                   str(tmp_path / "a.o"), str(tmp_path / "a.cu")]
    cmd = nvcc_command(tmp_path / "a.cu", tmp_path / "a.ptx", BuildMode.PTX, nvcc="nvcc", extra_flags=("-lineinfo",))
    assert cmd[-5:] == ["-lineinfo", "-ptx", "-o", str(tmp_path / "a.ptx"), str(tmp_path / "a.cu")]
