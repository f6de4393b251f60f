"""CuTe DSL lifter on the real FA4 wheel and CUTLASS's Ampere CuTe DSL example; corpus-wide coverage."""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import pytest

from kb.ir.expr import parse_expr
from ingest.corpus import lift_target, select_files
from ingest.fetch import fetch
from ingest.lift_cute import lift_file
from ingest.manifest import find_manifest
from ingest.model import LiftReport, ir_is_statement
from tests.support.repo import TEST_CACHE

pytestmark = pytest.mark.network


@pytest.fixture(autouse=True)
def _cache(monkeypatch):
    monkeypatch.setenv("KB_CACHE_DIR", str(TEST_CACHE))


@lru_cache(maxsize=None)
def _fa4() -> tuple[object, dict[str, LiftReport]]:
    m = find_manifest("flash-attn-4")
    src = fetch(m)
    targets, missing = select_files(m, src)
    assert not missing
    return src, {t.path.name: lift_file(t.path, src, t.family) for t in targets}


def test_fa4_masks_block_sparsity_and_softmax():
    src, reports = _fa4()
    mask = reports["mask.py"]
    kinds = Counter(s.kind for s in mask.snippets)
    assert kinds["mask_causal"] and kinds["mask_local"] and kinds["mask_mod"] and kinds["mask_bounds"]
    lines = (src.root / mask.file).read_text().split("\n")
    for s in mask.snippets:
        assert s.text == "\n".join(lines[s.provenance.line_start - 1 : s.provenance.line_end])
    causal = next(s for s in mask.snippets if s.kind == "mask_causal" and "if mask_causal" in s.title)
    assert "mask_causal" in lines[causal.provenance.line_start - 1]
    mod = next(s for s in mask.snippets if s.kind == "mask_mod" and "if " in s.title)
    assert "mask_mod is not None" in mod.text.split("\n")[0] + mod.text.split("\n")[1]
    sparse = [s for s in reports["block_sparse_utils.py"].snippets if s.kind == "block_sparse"]
    assert any("def consume_block_sparse_loads" in s.text for s in sparse)
    assert {"online_softmax", "softmax_rescale", "softmax_finalize", "score_mod"} <= {s.kind for s in reports["softmax.py"].snippets}
    assert any(s.kind == "split_kv_combine" for s in reports["flash_fwd_combine.py"].snippets)
    assert any(s.kind == "paged_kv" for s in reports["paged_kv.py"].snippets)


def test_fa4_sm90_tile_tunables_follow_head_dim_branches():
    src, reports = _fa4()
    rep = reports["interface.py"]
    lines = (src.root / rep.file).read_text().split("\n")
    sm90 = [t for t in rep.tunables if t.arch == "sm90"]
    hd64 = [t for t in sm90 if t.head_dim == 64 and "sparse_block_size_q" not in t.condition]
    hd128 = [t for t in sm90 if t.head_dim == 128]
    assert [(t.params["block_m"], t.params["block_n"]) for t in hd64] == [(192, 128)]
    assert [(t.params["block_m"], t.params["block_n"]) for t in hd128] == [(128, 128)]
    for t in sm90:
        line = lines[t.provenance.line_start - 1]
        assert "return FwdConfig(" in line and str(t.params["block_m"]) in line
    # Names resolve to the assignment of their own branch (hdim 192 vs 256 assign tile_n differently).
    assert {t.params["block_n"] for t in sm90 if t.head_dim in (0, 192)} == {
        "96 if is_local else 128 if head_dim_v <= 128 else 112", "64 if is_local else 80"}
    defaults = [t for r in reports.values() for t in r.tunables if t.condition.startswith("defaults of")]
    assert any(t.arch == "sm100" and t.params["block_m"] == 128 for t in defaults)


def test_cutlass_ampere_cute_example():
    m = find_manifest("flash-attn-2")
    src = fetch(m)
    (target,) = [t for t in select_files(m, src)[0] if t.lifter == "cute"]
    report = lift_file(target.path, src, target.family)
    kinds = {s.kind for s in report.snippets}
    assert {"mask_causal", "kv_loop_bounds", "softmax_rescale"} <= kinds
    (tun,) = report.tunables
    assert tun.arch == "sm80" and tun.params == {"block_m": 128, "block_n": 128, "num_threads": 128}


def test_syntax_error_is_skipped(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import cutlass.cute as cute\ndef f(:\n")
    report = lift_file(bad)
    assert report.snippets == () and "cannot parse" in report.skipped[0][1]


def test_corpus_coverage():
    """All manifests, CUDA and CuTe lifters: >= 40 snippets covering every variant; every IR checked.

    (The Triton lifter, which also interprets its programs, is tested in its own file.)"""
    sources = {name: fetch(find_manifest(name)) for name in ("flash-attn-2", "flash-attn-4", "nvidia-cutlass")}
    reports = [lift_target(t, src) for name, src in sources.items()
               for t in select_files(find_manifest(name), src)[0] if t.lifter in ("cuda", "cute")]
    snippets = [s for r in reports for s in r.snippets]
    kinds = Counter(s.kind for s in snippets)
    assert len(snippets) >= 40
    for kind in ("mask_causal", "mask_local", "alibi", "softcap", "dropout", "split_kv_combine", "paged_kv", "gqa",
                 "varlen", "block_sparse", "mask_mod", "online_softmax", "kv_loop_bounds", "epilogue"):
        assert kinds[kind], kind
    for s in snippets:
        if not ir_is_statement(s.ir_text):
            parse_expr(s.ir_text)
    assert sum(len(r.tunables) for r in reports) >= 50
