"""The Hopper backward (kb.lower.cuda_sm90_bwd) in the forward's `.cu`: which programs it stands in for, that nvcc
builds it for sm_90a on wgmma and bulk copies without spills at D=64 and D=128, the `kb_launch_bwd` entry, and the
generated module's dispatch to it (only where CUDA_BACKWARD lists the GPU: measured records decide).

Gradients on a GPU: `python -m bench.gpu.hopper_bwd_check OUT.json GEN_DIR SPEC...` (run 21: six variants at ragged and
bench shapes matched the spec's autograd); the GPU-only test below does the same for the causal fixture.
"""

from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.gpu.hopper_bwd_check import _relowered_copy
from generate.cuda_design import CudaPair, with_backward
from generate.pipeline import GenerateOptions, _Built, _with_backward
from generate.spec import load_spec
from kb.features import Features
from kb.ir.nodes import Dtype, Param, Role
from kb.ir.text import print_program
from kb.lower.cuda_dispatch import CudaDispatch
from kb.lower.cuda_sm90_bwd import BWD_PAD_Q, bwd_smem_bytes
from kb.lower.cuda_sm90_ir import backward_refusal, lower_program_sm90
from tests.support.cuda import build_sm90a, nvcc_or_skip
from tests.support.ir_programs import FIXTURES, backward, causal_bwd
from tests.support.repo import REPO
from verify.result import Verdict


def _bwd_for(name: str):
    """A backward program of fixture `name` (its score statements are what decides; the canonical causal one)."""
    return causal_bwd(Dtype.BF16)


@pytest.mark.parametrize("name", ["causal", "alibi", "document", "gqa", "plain"])
def test_the_hopper_backward_stands_in_where_dS_scales_by_sm_scale(name: str) -> None:
    assert backward_refusal(FIXTURES[name](dtype=Dtype.BF16), _bwd_for(name)) is None


def test_a_nonlinear_score_mod_or_a_learnable_table_keeps_the_triton_backward() -> None:
    why = backward_refusal(FIXTURES["softcap"](dtype=Dtype.BF16), _bwd_for("softcap"))
    assert why is not None and "derivative" in why
    why = backward_refusal(FIXTURES["causal"](dtype=Dtype.BF16), _learned_table_backward())
    assert why is not None and "aux gradients" in why


def _learned_table_backward():
    bias = Param("bias", ("Hq",), Dtype.F32, Role.AUX)
    return backward("table_bwd", score_mod="score + bias[h]", dtype=Dtype.BF16, aux=(bias,),
                    aux_grads=(("dbias", "bias"),))


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """(source, PTX, ptxas log) of the causal fixture's `.cu` with its backward at D=64 and D=128, built in parallel."""
    nvcc = nvcc_or_skip()
    root = tmp_path_factory.mktemp("sm90bwd")

    def one(head_dim: int) -> tuple[str, str, str]:
        src = lower_program_sm90(FIXTURES["causal"](dtype=Dtype.BF16), head_dim, backward=True)
        return (src, *build_sm90a(nvcc, src, root / str(head_dim), shared=True))

    cases = [64, 128]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(cases, pool.map(one, cases)))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_backward_builds_for_sm90a_on_wgmma_and_bulk_copies_without_spills(builds: dict, head_dim: int) -> None:
    src, ptx, log = builds[head_dim]
    bwd_ptx = ptx[ptx.index(".entry _Z11kb_sm90_bwd"):]
    bwd_ptx = bwd_ptx.split("// .globl")[0]  # up to the next entry
    for instr in ("wgmma.mma_async", "cp.async.bulk.tensor", "cp.reduce.async.bulk", "fence.proxy.async"):
        assert instr in bwd_ptx, instr
    assert "atom.global" not in bwd_ptx and "red.global" not in bwd_ptx  # dQ is added by bulk reductions
    spills = re.findall(r"Compiling entry function '(\w*kb_sm90_bwd\w*)'.*?(\d+) bytes spill stores", log, re.S)
    assert [n for n, _ in spills] and all(s == "0" for _, s in spills), log
    assert "C7510" not in log and "C7511" not in log and "C7512" not in log  # no serialised wgmma
    assert " T kb_launch_bwd" in log and " T kb_launch" in log
    assert f"static_assert(SMEM_BYTES == {bwd_smem_bytes(head_dim)}" in src and bwd_smem_bytes(head_dim) <= 227 * 1024


def test_without_backward_the_cu_is_the_forward_alone() -> None:
    src = lower_program_sm90(FIXTURES["causal"](dtype=Dtype.BF16), 128)
    assert "kb_launch_bwd" not in src and "kb_sm90_bwd" not in src


def _pair(speedup: float) -> CudaPair:
    return CudaPair("k-elsewhere", Features(mask="causal", dtype="bf16", backward=True), "NVIDIA H100 80GB HBM3",
                    {"D": 128, "B": 4}, "2026-12-06", triton_ms=1.0 * speedup, cuda_ms=1.0)


def test_generation_lists_the_backward_only_where_a_measurement_says_it_is_faster() -> None:
    fwd, bwd = FIXTURES["causal"](dtype=Dtype.BF16), causal_bwd(Dtype.BF16)
    src = lower_program_sm90(fwd, 128)
    base = CudaDispatch("gen_causal.cu", src, "sm_90a", {})
    target = Features(mask="causal", dtype="bf16", backward=True)
    faster, runs = with_backward(base, fwd, bwd, "sm90", 128, [_pair(1.3)], target)
    assert faster.has_backward and "kb_launch_bwd" in faster.source and list(faster.backward["sm90"]) == [128]
    assert runs.startswith("the `.cu` runs: measured 1.30x")
    slower, runs = with_backward(base, fwd, bwd, "sm90", 128, [_pair(0.78)], target)
    assert slower.has_backward and not slower.backward and runs.startswith("the Triton module runs: measured 0.78x")
    forward_only = [CudaPair(**{**_pair(2.0).__dict__, "features": Features(mask="causal", dtype="bf16")})]
    unmeasured, runs = with_backward(base, fwd, bwd, "sm90", 128, forward_only, target)  # a forward pair says nothing
    assert not unmeasured.backward and "no `.cu` of this lowering was measured" in runs
    portable = CudaDispatch("gen_causal.cu", "// portable", "sm_80", {})
    assert with_backward(portable, fwd, bwd, "sm90", 128, [_pair(2.0)], target)[0] is portable


def test_deterministic_generation_never_adds_the_hopper_backward() -> None:
    """--deterministic: the Hopper backward adds dq's partials in arrival order, so the module keeps the forward's
    dispatch as it was (no `kb_launch_bwd` in its `.cu`), and the report says why."""
    spec = load_spec(REPO / "examples" / "specs" / "sdpa_causal_d128_bf16.py")
    fwd, bwd = FIXTURES["causal"](dtype=Dtype.BF16), causal_bwd(Dtype.BF16)
    dispatch = CudaDispatch("gen.cu", lower_program_sm90(fwd, 128), "sm_90a", {})
    built = _Built(fwd, "", dispatch.source, {}, Verdict.passed, "", dispatch=dispatch)
    kept, why = _with_backward(spec, built, bwd, GenerateOptions(deterministic=True, cuda_pairs={}))
    assert kept is dispatch and not kept.has_backward and "--deterministic" in why
    added, why = _with_backward(spec, built, bwd, GenerateOptions(cuda_pairs={}))
    assert added is not None and added.has_backward and "kb_launch_bwd" in added.source and not added.backward


def test_a_relowered_copy_carries_this_checkouts_backward_and_the_padding_it_needs(tmp_path) -> None:
    """bench.gpu.hopper_bwd_check --relower: each Hopper-backward `.cu` of GEN_DIR lowered again from its `.kbir`, and
    the modules beside it padded as that lowering needs (an older module padded the scratch rows to 64, under another
    name)."""
    fwd = FIXTURES["causal"](dtype=Dtype.BF16)
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "gen_x.kbir").write_text(print_program(fwd))
    (gen / "gen_x.cu").write_text("#define KB_HEAD_DIM 64\n// an older lowering\nextern \"C\" int kb_launch_bwd();\n")
    (gen / "gen_x.py").write_text("CUDA_BWD_BLOCK_Q = 64  # the backward's query tile\nm_pad = -(-M // CUDA_BWD_PAD_Q)\n")
    (gen / "gen_y.cu").write_text("#define KB_HEAD_DIM 64\n// a forward alone\n")
    out = _relowered_copy(gen, tmp_path / "out")
    assert (out / "gen_x.cu").read_text() == lower_program_sm90(fwd, 64, backward=True)
    # one name, the one the current dispatch preamble reads (run 24: a module naming both failed with a NameError)
    assert (out / "gen_x.py").read_text() == (f"CUDA_BWD_PAD_Q = {BWD_PAD_Q}  # the backward's query tile\n"
                                              "m_pad = -(-M // CUDA_BWD_PAD_Q)\n")
    assert (out / "gen_y.cu").read_text() == (gen / "gen_y.cu").read_text()


_POST_CHECK = r"""
#include <cstdio>
#include <vector>
// The consumer warpgroups stage dQ tile (bh, row block rb, column tile ct) as an m64n64 accumulator holds it: value i
// of thread t at [i][t], for (row, col) = (64 rb + 16 (t / 32) + (t % 32) / 4 + 8 ((i / 2) % 2), 64 ct + 8 (i / 4) +
// 2 (t % 4) + i % 2). Every staged value of a row < M must be read once, by the thread that writes its (bh, row, col).
int main() {
  const long long BH = 3, M = 200, M_pad = 256, HDIM = KB_HEAD_DIM, n = BH * M_pad * HDIM;
  std::vector<long long> bh_of(n), row_of(n), col_of(n);
  std::vector<int> seen(n, 0);
  for (long long bh = 0; bh < BH; ++bh)
    for (long long rb = 0; rb < M_pad / 64; ++rb)
      for (long long ct = 0; ct < HDIM / 64; ++ct)
        for (int i = 0; i < 32; ++i)
          for (int t = 0; t < 128; ++t) {
            const long long off = (bh * M_pad + rb * 64) * HDIM + ct * 4096 + i * 128 + t;
            bh_of[off] = bh;
            row_of[off] = rb * 64 + 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2);
            col_of[off] = ct * 64 + 8 * (i / 4) + 2 * (t % 4) + i % 2;
          }
  for (long long p = 0; p < n / 8 + 1000; ++p) {
    const kb90b::KbPostAt at = kb90b::kb_post_at(p, BH, M, M_pad);
    if (!at.live) continue;
    for (int odd = 0; odd < 2; ++odd)
      for (int j = 0; j < 4; ++j) {
        const long long off = at.src + 128 * odd + j;
        if (off < 0 || off >= n || bh_of[off] != at.bh || row_of[off] != at.row || col_of[off] != at.col + 2 * j + odd) {
          std::printf("thread %lld reads %lld for (%lld, %lld, %lld)\n", p, off, at.bh, at.row, at.col + 2 * j + odd);
          return 1;
        }
        ++seen[off];
      }
  }
  for (long long off = 0; off < n; ++off)
    if (seen[off] != (row_of[off] < M ? 1 : 0)) {
      std::printf("value %lld (row %lld) read %d times\n", off, row_of[off], seen[off]);
      return 1;
    }
  std::printf("ok\n");
  return 0;
}
"""


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_post_kernel_reads_each_staged_dq_value_once_and_writes_it_where_it_belongs(tmp_path, head_dim: int) -> None:
    """kb_sm90_bwd_post's indexing (`kb_post_at`, host-callable) run on the CPU against the staging layout."""
    nvcc = nvcc_or_skip()
    cu = tmp_path / "post.cu"
    cu.write_text(lower_program_sm90(FIXTURES["causal"](dtype=Dtype.BF16), head_dim, backward=True) + _POST_CHECK)
    exe = tmp_path / "post"
    built = subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-o", str(exe), str(cu)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout + ran.stderr
