"""Triton lifter on the real pinned FA2 Triton sources: lifted programs run in the interpreter and match torch."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from ingest.fetch import fetch
from ingest.lift_triton import LiftedProgram, lift_file
from ingest.lift_verify import resolved_let
from ingest.manifest import find_manifest
from ingest.model import LiftReport, Provenance
from kb.ir.nodes import For, Mask
from kb.ir.text import parse_program, print_program

CACHE = Path(__file__).resolve().parent.parent / ".kb-test-cache"
pytestmark = pytest.mark.network
FILES = {
    "fa2": ("flash_attn/flash_attn_triton.py", "fa2_triton"),
    "prefill": ("flash_attn/flash_attn_triton_amd/fwd_prefill.py", "fa2_triton_amd"),
    "decode": ("flash_attn/flash_attn_triton_amd/fwd_decode.py", "fa2_triton_amd"),
}


def _base(rel: str) -> Provenance:
    return Provenance("flash-attn", "2.8.3.post2", rel, 1, 1, "triton", "")


@lru_cache(maxsize=None)
def _root() -> Path:
    src = fetch(find_manifest("flash-attn-2"))
    (top,) = [p for p in src.root.iterdir() if p.is_dir()]
    return top


@lru_cache(maxsize=None)
def _lift(key: str) -> tuple[Path, LiftReport]:
    rel, family = FILES[key]
    return _root() / rel, lift_file(_root() / rel, _base(f"{_root().name}/{rel}"), family)


@pytest.fixture
def lifted(monkeypatch):
    monkeypatch.setenv("KB_CACHE_DIR", str(CACHE))
    return _lift


def _prog(report: LiftReport, suffix: str) -> LiftedProgram:
    (p,) = [p for p in report.programs if p.name.endswith(suffix)]
    return p


def _line(path: Path, n: int) -> str:
    return path.read_text().splitlines()[n - 1]


def test_fa2_triton_forward_lifts_causal_and_noncausal(lifted):
    path, rep = lifted("fa2")
    names = sorted(p.name for p in rep.programs if not p.features.backward)
    assert names == ["fa2_triton_fwd_kernel", "fa2_triton_fwd_kernel_is_causal"]
    for p in rep.programs:
        assert p.verified, p.verify_note
        assert "interpreter" in p.verify_note and "torch" in p.verify_note
    causal = _prog(rep, "fwd_kernel_is_causal")
    assert causal.features.causal and str(causal.program.mask_mod.body) == "q_idx >= kv_idx"  # top-left, as the source
    assert _prog(rep, "fwd_kernel").program.mask_mod is None
    # launch constants: BLOCK = 128, num_stages=1
    assert (causal.program.schedule.block_m, causal.program.schedule.block_n, causal.program.schedule.num_stages) == (128, 128, 1)
    # block skipping from `end_n = ... tl.minimum((start_m + 1) * BLOCK_M, seqlen_k)`
    body = causal.program.kernels[0].body
    loops = [st for st in body if isinstance(st, For)]
    lets = {st.name: str(st.value) for st in body if hasattr(st, "name") and hasattr(st, "value")}
    assert len(loops) == 1 and str(loops[0].hi) == "end_n"
    assert lets["end_n"] == "minimum(BLOCK_M + BLOCK_M * m, N)"
    assert any(p.features.backward for p in rep.programs)  # the backward kernels: tests/test_ingest_lift_triton_bwd.py


def test_amd_prefill_flag_combinations_verified(lifted):
    path, rep = lifted("prefill")
    assert len(rep.programs) == 4 and all(p.verified for p in rep.programs)
    causal = _prog(rep, "attn_fwd_is_causal")
    # bottom-right aligned causal (offs_n_causal = offs_n + (seqlen_q - seqlen_k))
    assert str(causal.program.mask_mod.body) == "q_idx + N >= kv_idx + M"
    assert causal.features.causal
    alibi = _prog(rep, "attn_fwd_use_alibi")
    assert alibi.features.alibi and "alibi_slopes[b, h]" in str(alibi.program.score_mod.body)
    assert "abs(" in str(alibi.program.score_mod.body)
    # full blocks (no mask) then masked blocks: two KV loops, only the second masks
    loops = [st for st in causal.program.kernels[0].body if isinstance(st, For)]
    assert len(loops) == 2
    assert not any(isinstance(s, Mask) for s in loops[0].body)
    assert any(isinstance(s, Mask) and s.use_mask_mod for s in loops[1].body)
    # GQA head mapping from `off_h_k = off_h_q // GROUP_SIZE`
    assert "h // (Hq // Hkv)" in str(resolved_let(causal.program.kernels[0].body, "hk"))
    assert "Hkv=2" in causal.verify_note  # verified with grouped heads
    # schedule = the default (non-arch) autotune config; every config kept as a tunable
    s = causal.program.schedule
    assert (s.block_m, s.block_n, s.num_warps, s.num_stages) == (64, 64, 4, 1)
    cdna = [t for t in causal.tunables if t.arch == "cdna"]
    assert len(cdna) == 7 and cdna[0].params["block_m"] == 128 and cdna[0].params["waves_per_eu"] == 2
    for t in causal.tunables:
        if t.arch in ("cdna", "rdna"):
            assert "triton.Config" in _line(path, t.provenance.line_start)


def test_amd_decode_split_kv_with_combine(lifted):
    path, rep = lifted("decode")
    assert len(rep.programs) == 4 and all(p.verified for p in rep.programs)
    p = _prog(rep, "splitK_is_causal")
    assert p.features.split_kv and p.features.causal
    assert [k.name for k in p.program.kernels] == ["split", "combine"]
    assert p.program.schedule.block_m == 16 and p.program.schedule.block_n == 64  # launcher locals
    assert any(k == "split_kv_combine" for k in (s.kind for s in rep.snippets))


def test_snippet_spans_point_at_the_source(lifted):
    for key in FILES:
        path, rep = lifted(key)
        kinds = {s.kind for s in rep.snippets}
        assert {"online_softmax", "kv_loop_bounds", "epilogue"} <= kinds, (key, kinds)
        for s in rep.snippets:
            assert s.text.strip(), s
            first = s.text.splitlines()[0]
            if s.kind == "mask_causal":
                assert "tl.where" in s.text or ">=" in first
            if s.kind == "kv_loop_bounds":
                assert first.lstrip().startswith("for ")
    _, pre = lifted("prefill")
    assert any(s.kind == "dropout" and "ENABLE_DROPOUT" in s.text for s in pre.snippets)
    assert any(s.kind == "online_softmax" and "tl.max" in s.text and "tl.dot" in s.text for s in pre.snippets)


def test_lifted_programs_round_trip_through_text(lifted):
    for key in FILES:
        _, rep = lifted(key)
        for p in rep.programs:
            assert parse_program(print_program(p.program)) == p.program


def test_malformed_files_are_skipped_not_raised(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import triton\n@triton.jit\ndef f(:\n")
    rep = lift_file(bad, _base("bad.py"))
    assert not rep.programs and "syntax error" in rep.skipped[0][1]
    empty = tmp_path / "nojit.py"
    empty.write_text("def f(x):\n    return x\n")
    rep = lift_file(empty, _base("nojit.py"))
    assert not rep.programs and "no @triton.jit" in rep.skipped[0][1]
    odd = tmp_path / "odd.py"
    odd.write_text("import triton\nimport triton.language as tl\n@triton.jit\ndef k(Q, K, Out, BLOCK_N: tl.constexpr):\n"
                   "    q = tl.load(Q + tl.arange(0, BLOCK_N))\n    k = tl.load(K + tl.arange(0, BLOCK_N))\n"
                   "    tl.store(Out, tl.dot(q, k))\n")
    rep = lift_file(odd, _base("odd.py"))
    assert not rep.programs and rep.skipped
