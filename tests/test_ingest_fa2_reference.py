"""FA2 CUDA reference program: assembled from the CUDA lifter's output on the real pinned sdist, checked by the interpreter."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest

from ingest.corpus import lift_target, select_files
from ingest.fa2_reference import _expr, _pick, build_fa2_reference, build_fa2_references, masking_steps_cover
from ingest.fetch import fetch
from ingest.lift_triton import LiftedProgram
from ingest.manifest import find_manifest
from ingest.model import LiftReport
from kb.errors import KBError
from kb.ir.expr import free_vars, parse_expr
from kb.ir.nodes import For, IfBlock, Let, Mask
from kb.ir.text import parse_program, print_program
from kb.ir.validate import validate
from tests.support.repo import TEST_CACHE

pytestmark = pytest.mark.network


@lru_cache(maxsize=None)
def _lifted() -> tuple[object, tuple[LiftReport, ...]]:
    """The CUDA reports of csrc/flash_attn/src, as the corpus runner lifts them (manifest file selection)."""
    manifest = find_manifest("flash-attn-2")
    src = fetch(manifest)
    targets, _ = select_files(manifest, src)
    return src, tuple(lift_target(t, src) for t in targets if t.lifter == "cuda" and "flash_attn/src" in t.path.as_posix())


@lru_cache(maxsize=None)
def _built() -> tuple[LiftedProgram, LiftedProgram]:
    _, reports = _lifted()
    causal, plain = build_fa2_references(list(reports), [t for r in reports for t in r.tunables])
    return causal, plain


@pytest.fixture
def fa2(monkeypatch):
    monkeypatch.setenv("KB_CACHE_DIR", str(TEST_CACHE))
    return _lifted()


@pytest.fixture
def built(fa2):
    return _built()


def _snippet(reports, kind: str, file: str, line: int):
    (s,) = [s for r in reports for s in r.snippets
            if s.kind == kind and s.provenance.file.endswith(file) and s.provenance.line_start == line]
    return s


def _hdim128_sm80(reports):
    return [t for r in reports for t in r.tunables if t.family == "fa2_cuda" and t.arch == "sm80"
            and t.head_dim == 128 and "Is_dropout" not in t.condition.replace("!Is_dropout", "")]


def test_causal_program_is_verified_by_the_interpreter(built):
    causal, _ = built
    assert causal.verified, causal.verify_note
    assert "interpreter == dense torch" in causal.verify_note
    assert "blocks 128x64 and 16x16" in causal.verify_note
    assert "fully masked rows give o = 0, lse = -inf" in causal.verify_note  # seq_q > seq_kv, bottom-right
    assert causal.features.causal and causal.features.head_dim == 128 and causal.features.return_lse
    assert causal.features.arch == "sm80" and causal.family == "fa2_cuda"


def test_program_validates_and_round_trips(built):
    for lp in built:
        validate(lp.program)
        text = print_program(lp.program)
        assert parse_program(text) == lp.program
        assert print_program(parse_program(text)) == text


def test_mask_is_the_lifted_bottom_right_causal_mask(fa2, built):
    src, reports = fa2
    causal, plain = built
    masks = [s for r in reports for s in r.snippets if s.kind == "mask_causal" and s.provenance.file.endswith("mask.h")
             and {"M", "N"} <= free_vars(_expr(s))]  # bottom-right: mentions seqlen_q and seqlen_k
    assert masks, "the CUDA lifter gave no bottom-right causal mask"
    assert all(causal.program.mask_mod.body == parse_expr(s.ir_text) for s in masks)
    assert str(causal.program.mask_mod.body) == "q_idx + (N - M) >= kv_idx"
    assert plain.program.mask_mod is None and not plain.features.causal


def test_structure_reverse_kv_loop_masked_blocks_first(built):
    for lp in built:
        body = lp.program.kernels[0].body
        assert lp.program.schedule.kv_order == "reverse"
        (loop,) = [st for st in body if isinstance(st, For)]
        assert loop.order == "reverse" and str(loop.lo) == "0" and str(loop.hi) == "n_block_max * BLOCK_N"
        (guard,) = [st for st in loop.body if isinstance(st, IfBlock)]
        assert guard.negate and guard.cls.value == "full" and isinstance(guard.then[0], Mask)
        lets = {st.name: str(st.value) for st in body if isinstance(st, Let)}
        assert lets["hk"] == "h // (Hq // Hkv)"  # GQA head map from the lifted snippet
    causal, plain = built
    lets = {st.name: str(st.value) for st in causal.program.kernels[0].body if isinstance(st, Let)}
    assert lets["n_block_max"] == "minimum(cdiv(N, BLOCK_N), cdiv((m + 1) * BLOCK_M + N - M, BLOCK_N))"
    lets = {st.name: str(st.value) for st in plain.program.kernels[0].body if isinstance(st, Let)}
    assert lets["n_block_max"] == "cdiv(N, BLOCK_N)"


def test_schedule_is_the_hdim128_sm80_launch_tunable(fa2, built):
    src, reports = fa2
    (tun,) = {(t.params["block_m"], t.params["block_n"], t.params["num_warps"]) for t in _hdim128_sm80(reports)}
    for lp in built:
        s = lp.program.schedule
        assert (s.block_m, s.block_n, s.num_warps) == tun == (128, 64, 4)
        assert s.head_pad == 128
        assert any(t.head_dim == 128 and t.params["block_m"] == 128 for t in lp.tunables)
    line = (src.root / _hdim128_sm80(reports)[0].provenance.file).read_text().splitlines()[
        _hdim128_sm80(reports)[0].provenance.line_start - 1]
    assert "Flash_fwd_kernel_traits<Headdim, 128, 64, 4" in line


def test_provenance_points_at_compute_attn_1rowblock(fa2, built):
    src, _ = fa2
    for lp in built:
        p = lp.provenance
        assert p.file.endswith("csrc/flash_attn/src/flash_fwd_kernel.h") and p.lifter == "fa2_reference"
        lines = (src.root / p.file).read_text().splitlines()
        fn = next(i for i, ln in enumerate(lines, 1) if "void compute_attn_1rowblock(" in ln)
        fn_split = next(i for i, ln in enumerate(lines, 1) if "void compute_attn_1rowblock_splitkv(" in ln)
        assert fn < p.line_start < p.line_end < fn_split
        assert "n_block_min = " in lines[p.line_start - 1]  # the first lifted region of the kernel body
        assert any("mask.h:188-192" in n for n in lp.notes) or not lp.program.mask_mod


def test_static_masking_steps_cover_the_blocks_the_ir_masks(fa2, built):
    _, reports = fa2
    causal, _ = built
    steps = _expr(_pick([s for r in reports for s in r.snippets]).masking_steps)
    small = replace(causal.program, schedule=replace(causal.program.schedule, block_m=16, block_n=16))
    shapes = [(45, 30), (37, 50), (100, 77)]  # N - M off the 16-grid: the diagonal spans two KV blocks
    assert masking_steps_cover(steps, small, shapes, causal=True)  # FA2's count for ragged lengths
    assert not masking_steps_cover(steps, small, shapes, causal=True, even_mn=True)  # one step short
    assert any("covers the IR's masked blocks: True" in n for n in causal.notes)


def test_missing_pieces_raise_kberror_naming_them(fa2):
    _, reports = fa2
    tunables = [t for r in reports for t in r.tunables]
    no_mask = [replace(r, snippets=tuple(s for s in r.snippets if s.kind != "mask_causal")) for r in reports]
    with pytest.raises(KBError, match="mask_causal"):
        build_fa2_reference(no_mask, tunables)
    no_bounds = [replace(r, snippets=tuple(s for s in r.snippets if s.kind != "kv_loop_bounds")) for r in reports]
    with pytest.raises(KBError, match="kv_loop_bounds"):
        build_fa2_reference(no_bounds, tunables)
    with pytest.raises(KBError, match="head_dim=128 launch tunable"):
        build_fa2_reference(list(reports), [])
