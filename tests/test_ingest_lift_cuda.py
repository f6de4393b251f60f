"""CUDA C++ lifter on the real pinned FA2 and CUTLASS sources (downloaded once into .kb-test-cache)."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

from kb.ir.expr import parse_expr
from ingest.corpus import select_files
from ingest.fetch import fetch
from ingest.lift_cuda import lift_file
from ingest.manifest import find_manifest
from ingest.model import LiftReport, ir_is_statement

CACHE = Path(__file__).resolve().parent.parent / ".kb-test-cache"
pytestmark = pytest.mark.network


@lru_cache(maxsize=None)
def _lifted(name: str) -> tuple[object, dict[str, LiftReport]]:
    src = fetch(find_manifest(name))
    targets, _ = select_files(find_manifest(name), src)
    return src, {t.path.relative_to(src.root).as_posix(): lift_file(t.path, src, t.family)
                 for t in targets if t.lifter == "cuda"}


@pytest.fixture
def fa2(monkeypatch):
    monkeypatch.setenv("KB_CACHE_DIR", str(CACHE))
    return _lifted("flash-attn-2")


@pytest.fixture
def cutlass(monkeypatch):
    monkeypatch.setenv("KB_CACHE_DIR", str(CACHE))
    return _lifted("nvidia-cutlass")


def _report(reports: dict[str, LiftReport], suffix: str) -> LiftReport:
    (key,) = [k for k in reports if k.endswith(suffix)]
    return reports[key]


def _lines(src, rel: str) -> list[str]:
    return (src.root / rel).read_text().split("\n")


def test_fa2_kinds_cover_the_variants(fa2):
    _, reports = fa2
    kinds = {s.kind for r in reports.values() for s in r.snippets}
    assert {"mask_causal", "mask_local", "mask_bounds", "alibi", "softcap", "dropout", "split_kv_combine", "paged_kv",
            "gqa", "varlen", "epilogue", "kv_loop_bounds", "online_softmax", "softmax_rescale", "split_kv_heuristic"} <= kinds


def test_every_snippet_has_exact_span_and_valid_ir(fa2, cutlass):
    for src, reports in (fa2, cutlass):
        for rel, report in reports.items():
            lines = _lines(src, rel)
            for s in report.snippets:
                p = s.provenance
                assert (p.distribution, p.version, p.file, p.lifter) == (src.distribution, src.version, rel, "cuda")
                assert 1 <= p.line_start <= p.line_end <= len(lines)
                assert s.text == "\n".join(lines[p.line_start - 1 : p.line_end])
                if not ir_is_statement(s.ir_text):
                    parse_expr(s.ir_text)


def test_fa2_spans_point_at_the_right_code(fa2):
    src, reports = fa2
    mask = _report(reports, "src/mask.h")
    by_title = {s.title: s for s in mask.snippets}
    local = next(s for t, s in by_title.items() if "function apply_mask_local" in t)
    assert "apply_mask_local" in local.text.split("\n")[1] and local.text.startswith("template")
    assert local.ir_text == "(kv_idx <= q_idx + (N - M) + window_right) & (kv_idx >= q_idx + (N - M) - window_left)"
    causal_branch = next(s for s in mask.snippets if "if Causal_mask" in s.title)
    assert "Causal_mask" in causal_branch.text.split("\n")[0] and causal_branch.features["causal"] is True
    general = next(s for s in mask.snippets if s.kind == "alibi" and "else" in s.title)
    assert "abs(row_idx + max_seqlen_k - max_seqlen_q - col_idx)" in general.text
    assert general.ir_text == "score - slopes[h] * abs(q_idx + (N - M) - kv_idx)"
    kernel = _report(reports, "src/flash_fwd_kernel.h")
    softcap = [s for s in kernel.snippets if s.kind == "softcap"]
    assert softcap and all("Is_softcap" in s.text.split("\n")[0] for s in softcap)
    paged = [s for s in kernel.snippets if s.kind == "paged_kv"]
    assert paged and all("block_table" in s.text for s in paged)
    combine = next(s for s in kernel.snippets if s.kind == "split_kv_combine" and s.title.startswith("Split-KV combine: LSE"))
    assert "combine_attn_seqk_parallel" in "\n".join(combine.text.split("\n")[:2])
    bounds = next(s for s in kernel.snippets if s.ir_text.startswith("minimum(cdiv(N, BLOCK_N), cdiv((m + 1)"))
    assert "Is_causal || Is_local" in bounds.text.split("\n")[0] and "n_block_max" in bounds.text
    heuristic = next(s for r in reports.values() for s in r.snippets if s.kind == "split_kv_heuristic")
    assert "num_splits_heuristic" in heuristic.text.split("\n")[0]


def _traits_in_file(lines: list[str], hdim: int) -> set[tuple[int, int, int]]:
    """(kBlockM, kBlockN, kNWarps) of the non-comment Flash_fwd_kernel_traits lines in run_mha_fwd_hdim{hdim}."""
    start = next(i for i, l in enumerate(lines) if re.search(rf"void run_mha_fwd_hdim{hdim}\(", l))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("}"))
    found = set()
    for line in lines[start:end]:
        m = re.search(r"Flash_fwd_kernel_traits<Headdim, (\d+), (\d+), (\d+),", line)
        if m and not line.strip().startswith("//"):
            found.add(tuple(int(g) for g in m.groups()))
    return found


@pytest.mark.parametrize("hdim", [64, 128])
def test_fa2_tunables_match_launch_template(fa2, hdim):
    src, reports = fa2
    rel = next(k for k in reports if k.endswith("flash_fwd_launch_template.h"))
    lines = _lines(src, rel)
    tunables = [t for t in reports[rel].tunables if t.family == "fa2_cuda" and t.head_dim == hdim and t.dtype == "bf16"]
    lifted = {(t.params["block_m"], t.params["block_n"], t.params["num_warps"]) for t in tunables}
    assert lifted == _traits_in_file(lines, hdim) and lifted
    for t in tunables:
        line = lines[t.provenance.line_start - 1]
        assert f"Flash_fwd_kernel_traits<Headdim, {t.params['block_m']}, {t.params['block_n']}, {t.params['num_warps']}," in line
    if hdim == 64:
        assert {(t.params["block_n"], t.condition) for t in tunables} == {(128, "!Is_dropout"), (64, "Is_dropout")}
    else:
        sm86 = {(t.params["block_m"], t.params["block_n"]) for t in tunables if t.arch == "sm86"}
        assert sm86 == {(128, 32), (64, 64)}  # sm86/89: 64x64 causal, 128x32 non-causal


def test_fa2_splitkv_tunables_evaluate_the_ternary(fa2):
    _, reports = fa2
    rel = next(k for k in reports if k.endswith("flash_fwd_launch_template.h"))
    split = {t.head_dim: t.params["block_n"] for t in reports[rel].tunables if t.family == "fa2_cuda_splitkv"}
    assert split == {32: 256, 64: 256, 96: 128, 128: 128, 192: 64, 256: 64}  # Headdim <= 64 ? 256 : (<= 128 ? 128 : 64)


def test_cutlass_fmha_tiles_and_masks(cutlass):
    src, reports = cutlass
    hopper = _report(reports, "88_hopper_fmha/88_hopper_fmha.cu")
    fwd128 = {(t.params["block_m"], t.params["block_n"], t.params.get("kernel")) for t in hopper.tunables
              if t.family == "cutlass_fmha_sm90" and t.head_dim == 128}
    assert (128, 128, "KernelCooperative") in fwd128 and all(t.arch == "sm90" for t in hopper.tunables)
    lines = _lines(src, next(k for k in reports if k.endswith("88_hopper_fmha.cu")))
    for t in hopper.tunables:
        assert re.search(rf"Shape<\s*_{t.params['block_m']},\s*_{t.params['block_n']},", lines[t.provenance.line_start - 1])
    bw = _report(reports, "77_blackwell_fmha/collective/fmha_fusion.hpp")
    qend = next(s for s in bw.snippets if s.kind == "mask_causal" and "offset_q" in s.title)
    assert qend.ir_text == "q_idx + (N - M) >= kv_idx" and "offset_q" in qend.text
    assert any(s.kind == "kv_loop_bounds" for s in bw.snippets)


def test_bad_input_is_reported_not_raised(tmp_path):
    junk = tmp_path / "junk.cu"
    junk.write_text("}}}} template <<< ((( not c++ at all\n")
    report = lift_file(junk)
    assert report.snippets == () and report.skipped
    binary = tmp_path / "bin.h"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert "cannot read" in lift_file(binary).skipped[0][1]
    assert lift_file(tmp_path / "missing.h").skipped


def test_fa2_backward_regions_are_snippets_marked_backward(fa2):
    src, reports = fa2
    kernel = _report(reports, "src/flash_bwd_kernel.h")
    kinds = {s.kind for s in kernel.snippets}
    assert {"bwd_probs", "bwd_softmax_grad", "bwd_dq_accumulate", "bwd_dkdv_epilogue", "bwd_loop_bounds",
            "bwd_score_mod_grad", "mask_causal", "mask_bounds"} <= kinds
    assert all(s.features.get("backward") for s in kernel.snippets)
    atomic = next(s for s in kernel.snippets if "atomicAdd" in s.title)
    assert "atomicAdd(&tdQgdQaccum(i), acc_dq(i))" in atomic.text and "+= dqp" in atomic.ir_text
    ds = next(s for s in kernel.snippets if s.kind == "bwd_softmax_grad")
    assert "pointwise_mult" in ds.text and ds.ir_text == "softmax_grad ds = p * (dp - dt)"
    pre = _report(reports, "src/flash_bwd_preprocess_kernel.h")
    assert {s.kind for s in pre.snippets} >= {"bwd_delta", "bwd_dq_accumulate", "bwd_dkdv_epilogue"}
    forward = _report(reports, "src/flash_fwd_kernel.h")
    assert not any(s.features.get("backward") for s in forward.snippets)


def test_fa2_backward_tunables_per_head_dim_and_arch(fa2):
    src, reports = fa2
    rel = next(k for k in reports if k.endswith("flash_bwd_launch_template.h"))
    bwd = [t for t in reports[rel].tunables if t.dtype == "bf16"]
    assert bwd and all(t.family == "fa2_cuda_bwd" and t.params["direction"] == "backward" for t in bwd)
    by = {(t.head_dim, t.arch): (t.params["block_m"], t.params["block_n"], t.params["num_warps"]) for t in bwd}
    assert by[(128, "sm80")] == (64, 128, 8) and by[(128, "sm86")] == (64, 64, 8)  # 144 KB of smem or less
    assert by[(256, "sm90")] == (64, 64, 8) and by[(256, "sm86")] == (64, 32, 8)
    assert {hd for hd, _ in by} == {32, 64, 96, 128, 192, 256}
    lines = _lines(src, rel)
    for t in bwd:
        assert f"Flash_bwd_kernel_traits<Headdim, {t.params['block_m']}, {t.params['block_n']}," in lines[t.provenance.line_start - 1]
    fwd = _report(reports, "flash_fwd_launch_template.h")
    assert not any(t.params.get("direction") for t in fwd.tunables)
