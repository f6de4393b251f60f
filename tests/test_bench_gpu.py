"""GPU bench plumbing on CPU: suite programs match their torch semantics, FLOP counting, JSON report, no-GPU error."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json
import math
import types

import pytest
import torch

from bench.gpu import baselines, suite, tune_common
from bench.gpu.record import record_results
from bench.gpu.report import geomean, summarize, summary_table
from bench.gpu.run import SCHEMA, Record, _write, require_cuda
from kb.errors import KBError
from kb.ir.design import Design
from kb.ir.nodes import Schedule
from kb.ir.text import content_hash, print_program
from kb.lower.runtime import TritonKernel
from kb.lower.triton import lower_program
from kb.lower.triton_aot import compile_for_arch
from kb.store import Kernel, PerfRecord
from verify.timing import Timing


@pytest.mark.parametrize("variant", sorted(suite.VARIANTS))
def test_suite_program_matches_torch_semantics(variant: str, tmp_path) -> None:
    # small blocks so the interpreter is quick; S not a multiple of the blocks; window/prefix scaled by the case
    long = variant == "sliding_window"  # S must exceed the 1024 window; one head keeps the interpreter quick
    case = suite.Case(variant, 1, 1 if long else 2, 1 if variant == "gqa" or long else 2, 1100 if long else 80, 32)
    prog, source = suite.load_program(variant)
    assert source.startswith(("builder:", "kbir:"))
    prog = suite.with_schedule(prog, Schedule(block_m=32, block_n=16, num_warps=4, num_stages=1))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(case.B, case.Hq, case.S, case.D, generator=g).to(torch.bfloat16)
    k = torch.randn(case.B, case.Hkv, case.S, case.D, generator=g).to(torch.bfloat16)
    v = torch.randn(case.B, case.Hkv, case.S, case.D, generator=g).to(torch.bfloat16)
    aux = suite.aux_tensors(case, "cpu")
    mask, score = suite.torch_mods(case, aux)
    o = TritonKernel.from_program(prog, tmp_path).run({"q": q, "k": k, "v": v, **suite.declared_aux(prog, aux)})["o"].float()
    ref = baselines.eager_fn(case, q, k, v, mask, score)().float()
    assert float((o - ref).norm() / ref.norm()) < 1e-2 and float((o - ref).abs().max()) < 0.1


def test_attended_pairs_are_exact() -> None:
    c = suite.Case("causal", 2, 16, 16, 100, 64)
    mask, _ = suite.torch_mods(c, {})
    assert suite.attended_pairs(c, mask, "cpu", chunk=7) == 2 * 100 * 101 // 2
    assert suite.attended_pairs(suite.Case("plain", 2, 16, 16, 100, 64), None, "cpu") == 2 * 100 * 100
    sw = suite.Case("sliding_window", 1, 1, 1, 3000, 64)
    m, _ = suite.torch_mods(sw, {})
    W = suite.WINDOW
    assert suite.attended_pairs(sw, m, "cpu") == sum(min(i + 1, W) for i in range(3000))
    assert suite.attention_flops(c, 10) == 4.0 * 16 * 64 * 10


def test_suites_cover_the_required_variants() -> None:
    cases = suite.suite_cases("h200")
    assert {c.variant for c in cases} >= {"causal", "sliding_window", "alibi", "softcap", "document", "prefix_lm", "gqa"}
    assert all(c.B * c.S == 32768 for c in cases) and {c.D for c in cases} == {64, 128}
    with pytest.raises(KBError, match="unknown bench suite"):
        suite.suite_cases("nope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_no_gpu_is_a_clear_user_error() -> None:
    with pytest.raises(KBError, match="kb bench needs a CUDA GPU"):
        require_cuda()


def test_json_schema_and_table(tmp_path) -> None:
    env = {"gpu": "NVIDIA H200", "driver": "570", "torch_version": "2.11", "triton_version": "3.6", "cuda": "12.8",
           "command": "run.py smoke", "date": "2026-01-01T00:00:00+00:00"}
    shape = {"B": 1, "Hq": 2, "Hkv": 2, "M": 512, "N": 512, "D": 64, "attended_pairs": 10, "flops": 1.0}
    recs = [Record("c1", "causal", impl, "x", shape, "bf16", "ok", ms=ms, tflops=1 / ms, frac_peak=0.1)
            for impl, ms in (("generated", 1.0), ("generated[64x64 w4 s3]", 0.5), ("flex", 2.0), ("sdpa-cudnn", 1.0))]
    recs.append(Record("c1", "causal", "eager", "x", shape, "bf16", "oom", error="CUDA out of memory"))
    path = tmp_path / "b.json"
    _write(path, env, 800.0, recs, "smoke")
    doc = json.loads(path.read_text())
    assert doc["schema"] == SCHEMA and doc["peak_bf16_tflops"] == 800.0
    for r in doc["records"]:
        assert {"gpu", "driver", "torch_version", "triton_version", "shape", "dtype", "ms", "tflops", "command",
                "date", "impl", "status"} <= set(r)
    (s,) = summarize(doc)
    assert s.speedup("flex") == 2.0 and s.best_generated == "generated[64x64 w4 s3]"
    assert math.isclose(geomean([2.0, 8.0]), 4.0)
    table = summary_table(doc)
    assert "geomean speedup vs flex: default schedule 2.00x, best schedule 4.00x" in table


def test_record_results_writes_measured_perf_for_matching_kernels(kb, tmp_path) -> None:
    prog, _ = suite.load_program("causal")
    kid = kb.write_kernel(Kernel(name="causal", family="generated", ir_text=print_program(prog), dtype="bf16",
                                 head_dim=128))
    env = {"gpu": "NVIDIA H200", "driver": "570", "torch_version": "2.11", "triton_version": "3.6", "cuda": "12.8",
           "command": "run.py h200", "date": "2026-01-01T00:00:00+00:00"}
    shape = {"B": 4, "Hq": 16, "Hkv": 16, "M": 8192, "N": 8192, "D": 128, "attended_pairs": 1, "flops": 1.0}
    recs = [Record("c", "causal", "generated", "x", shape, "bf16", "ok", ms=2.0, tflops=450.0, content_hash=content_hash(prog)),
            Record("c", "causal", "flex", "x", shape, "bf16", "ok", ms=3.0, tflops=300.0),
            Record("c", "causal", "generated", "x", shape, "bf16", "ok", ms=2.0, tflops=450.0, content_hash="0" * 64)]
    path = tmp_path / "r.json"
    _write(path, env, 760.0, recs, "h200")
    assert record_results(kb, path) == 1
    assert record_results(kb, path) == 1  # idempotent: same measurement, same row
    (row,) = kb.list(PerfRecord, kernel_id=kid)
    assert (row.kind, row.gpu, row.ms, row.tflops, row.dtype) == ("measured", "NVIDIA H200", 2.0, 450.0, "bf16")


@pytest.mark.parametrize("variant", ["causal", "document", "prefix_lm"])
def test_bench_kernels_compile_for_hopper(variant: str) -> None:
    """The GPU path the interpreter never runs: Triton's compiler (bundled ptxas) builds the bench schedule for
    sm_90 with TMA, using wgmma and bulk tensor copies; the document mask takes the indexed KV loop over its
    block table, prefix-LM (a per-batch prefix) has closed-form block classes and no table."""
    prog, _ = suite.load_program(variant)
    prog = Design(128, 128, 8, 3).apply(prog)  # the design measured best for causal D=128 on the H200
    assert ("_kvl_full_" in lower_program(prog)) == (variant == "document")
    (k,) = compile_for_arch(prog, arch=90, head_dim=128, tma=True)
    assert k.wgmma > 0 and k.tma_loads > 0
    assert k.shared_bytes <= 227 * 1024  # sm_90's opt-in shared memory per block


def test_a_slow_baseline_is_timed_a_few_times_and_says_how_many(monkeypatch: pytest.MonkeyPatch) -> None:
    """time_call: a call slower than SLOW_CALL_S (FlexAttention's 1.4 s T5 step) gets no warm-up and SLOW_TRIALS
    trials; a fast one the asked-for trials after 5 warm-up calls. The count is returned for the record."""
    asked: list[tuple[int, int]] = []

    def fake_time_fn(fn, warmup, trials, drain):
        asked.append((warmup, trials))
        return Timing(1.0, 0.1, 0.9, 1.1, trials)

    ticks = [0.0, 0.01, 10.0, 10.0 + 2 * tune_common.SLOW_CALL_S]  # a fast first call, then a slow one

    def clock() -> float:
        return ticks.pop(0) if ticks else 99.0
    monkeypatch.setattr(tune_common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune_common, "sync", lambda: None)
    monkeypatch.setattr(tune_common, "time_fn", fake_time_fn)
    monkeypatch.setattr(tune_common.time, "perf_counter", clock)
    assert tune_common.time_call(lambda: None, 10) == (1.0, 0.1, 10)
    assert tune_common.time_call(lambda: None, 10) == (1.0, 0.1, tune_common.SLOW_TRIALS)
    assert asked == [(5, 10), (0, tune_common.SLOW_TRIALS)]


def test_first_listed_runs_the_module_untimed_and_restores_its_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The `emitted-first-listed` ablation: inside, KB_DESIGN_TIMING=0 and no choice kept; after, both as they were."""
    monkeypatch.delenv("KB_DESIGN_TIMING", raising=False)
    mod = types.SimpleNamespace(_PICKED={("k",): (64, 64)}, _BWD_PICKED={("k",): (32, 64)}, _PLANS={("c",): "plan"})
    with tune_common.first_listed(mod):  # type: ignore[arg-type]
        # no launch plan either: an eager call would replay the timed design's launches without choosing
        assert os.environ["KB_DESIGN_TIMING"] == "0" and not mod._PICKED and not mod._BWD_PICKED and not mod._PLANS
        mod._PICKED[("k",)] = (128, 64)  # the untimed choice made inside
        mod._PLANS[("c",)] = "untimed plan"
    assert "KB_DESIGN_TIMING" not in os.environ
    assert mod._PICKED == {("k",): (64, 64)} and mod._BWD_PICKED == {("k",): (32, 64)}
    assert mod._PLANS == {("c",): "plan"}
