"""Backward kernels lift into verified backward IR programs by dataflow: FA2's Triton backward from the
pinned sdist, and small backward kernels this test writes itself (renamed, reformulated, broken)."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

from ingest.fetch import fetch
from ingest.lift_triton import lift_file
from ingest.manifest import find_manifest
from ingest.model import LiftReport, Provenance
from kb.ir.nodes import For, Probs, Store, is_backward, walk_stmts
from kb.ir.text import parse_program, print_program
from tests.support.backward import fa2_provenance, fa2_triton_lift
from tests.support.repo import TEST_CACHE

@pytest.fixture
def fa2(monkeypatch):
    monkeypatch.setenv("KB_CACHE_DIR", str(TEST_CACHE))
    return fa2_triton_lift()


def _backward(rep: LiftReport) -> dict[str, object]:
    return {p.name: p for p in rep.programs if p.features.backward}


@pytest.mark.network
def test_fa2_backward_lifts_four_verified_programs(fa2):
    path, rep = fa2
    progs = _backward(rep)
    assert sorted(progs) == ["fa2_triton_bwd_kernel", "fa2_triton_bwd_kernel_is_causal",
                             "fa2_triton_bwd_kernel_is_causal_sequence_parallel", "fa2_triton_bwd_kernel_sequence_parallel"]
    for p in progs.values():
        assert p.verified and "torch autograd" in p.verify_note, p.verify_note
        assert is_backward(p.program) and p.features.backward
        assert [k.name for k in p.program.kernels] == ["bwd_preprocess", "bwd_dkdv", "bwd_dq"]
        assert parse_program(print_program(p.program)) == p.program
        text = path.read_text().splitlines()
        assert text[p.provenance.line_start - 1].startswith("def _bwd_kernel(")  # provenance: the kernel's span
        s = p.program.schedule  # the autotune config of its SEQUENCE_PARALLEL value
        assert (s.block_m, s.block_n, s.num_warps, s.num_stages) == (128, 128, 8, 1)
    causal = progs["fa2_triton_bwd_kernel_is_causal_sequence_parallel"]
    assert str(causal.program.mask_mod.body) == "q_idx >= kv_idx" and causal.features.causal
    assert progs["fa2_triton_bwd_kernel"].program.mask_mod is None


@pytest.mark.network
def test_fa2_backward_structure_follows_the_source(fa2):
    _, rep = fa2
    progs = _backward(rep)
    par = progs["fa2_triton_bwd_kernel_is_causal_sequence_parallel"].program
    dkdv = par.kernels[1]
    assert [a.name for a in dkdv.grid] == ["b", "h", "n"]  # one program per KV block (atomics)
    (mloop,) = [st for st in dkdv.body if isinstance(st, For)]
    assert str(mloop.lo) == "BLOCK_M * (BLOCK_N * n // BLOCK_M)"  # begin_m: the causal start
    assert any(isinstance(st, Store) and st.accumulate and st.tensor == "dq_acc" for st in mloop.body)
    assert any(isinstance(st, Probs) for st in mloop.body)
    serial = progs["fa2_triton_bwd_kernel_is_causal"].program.kernels[1]
    assert [a.name for a in serial.grid] == ["b", "h"]  # one program per (b, h) looping over KV blocks
    (nloop,) = [st for st in serial.body if isinstance(st, For)]
    assert nloop.var == "n" and str(nloop.hi) == "cdiv(N, BLOCK_N)"
    notes = " ".join(progs["fa2_triton_bwd_kernel_is_causal"].notes)
    assert "load-add-store" in notes and "early exit" in notes and "linked by its launch" in notes


@pytest.mark.network
def test_fa2_backward_snippets_and_tunables_are_marked(fa2):
    _, rep = fa2
    kinds = {s.kind for s in rep.snippets if s.features.get("backward")}
    assert {"bwd_delta", "bwd_probs", "bwd_softmax_grad", "bwd_dq_accumulate", "bwd_dkdv_epilogue"} <= kinds
    for s in rep.snippets:
        if s.kind == "bwd_softmax_grad":
            assert "ds = (p * (dp - Di[:, None]) * softmax_scale)" in s.text
    bwd = [t for t in rep.tunables if t.params.get("direction") == "backward"]
    assert {t.params["sequence_parallel"] for t in bwd} == {False, True}
    fwd = [p for p in rep.programs if not p.features.backward]
    assert all(t.params.get("direction") != "backward" and "sequence_parallel" not in t.params
               for p in fwd for t in p.tunables)
    assert not any("_bwd" in what for what, _ in rep.skipped)


AMD = "flash_attn/flash_attn_triton_amd/bwd_prefill_split.py"


@lru_cache(maxsize=None)
def _amd() -> LiftReport:
    src = fetch(find_manifest("flash-attn-2"))
    (top,) = [p for p in src.root.iterdir() if p.is_dir()]
    return lift_file(top / AMD, fa2_provenance(f"{top.name}/{AMD}"), "fa2_triton_amd")


@pytest.mark.network
def test_amd_split_backward_pairs_dkdv_with_its_dq_pass(monkeypatch):
    monkeypatch.setenv("KB_CACHE_DIR", str(TEST_CACHE))
    rep = _amd()
    progs = _backward(rep)
    assert sorted(progs) == ["fa2_triton_amd_bwd_kernel_dkdv_noncausal", "fa2_triton_amd_bwd_kernel_dkdv_noncausal_use_alibi"]
    plain = progs["fa2_triton_amd_bwd_kernel_dkdv_noncausal"]
    assert plain.verified and "Hq=4 Hkv=2" in plain.verify_note  # GQA: the q heads of a KV head in a loop
    dkdv, dq = plain.program.kernels[1:]
    assert [a.name for a in dkdv.grid] == ["b", "hk", "n"] and [a.name for a in dq.grid] == ["b", "hk", "m"]
    assert isinstance(dkdv.body[-3], For) and dkdv.body[-3].var == "h"
    assert "dq_acc" not in {p.name for p in plain.program.params}  # dq by a separate pass, in registers
    assert (plain.program.schedule.block_m, plain.program.schedule.block_n) == (32, 128)  # the dK/dV launch's tiles
    alibi = progs["fa2_triton_amd_bwd_kernel_dkdv_noncausal_use_alibi"]
    assert alibi.features.alibi and "alibi_slopes[b, h]" in str(alibi.program.score_mod.body)
    causal = dict(rep.backward)
    assert any("fraction of a block" in why for what, why in causal.items() if "dkdv_causal" in what)


# ---------------------------------------------------------------- kernels written here (FA2's style, not its code)

KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def row_dot(OUT, GRAD, DLT, s_b, s_h, s_r, heads, seq_a, dim, BM: tl.constexpr, BD: tl.constexpr):
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    rows = blk * BM + tl.arange(0, BM)
    cols = tl.arange(0, BD)
    msk = (rows[:, None] < seq_a) & (cols[None, :] < dim)
    at = (bh // heads) * s_b + (bh % heads) * s_h + rows[:, None] * s_r + cols[None, :]
    x = tl.load(OUT + at, mask=msk, other=0.0).to(tl.float32)
    y = tl.load(GRAD + at, mask=msk, other=0.0).to(tl.float32)
    tl.store(DLT + bh * seq_a + rows, tl.sum(x * y, axis=1), mask=rows < seq_a)


@triton.jit
def grads(Qp, Kp, Vp, Gp, Lp, Dp, DQp, DKp, DVp, scale, s_b, s_h, s_r, heads, seq_a, seq_b, dim,
          MASKED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    col = tl.program_id(0)
    bh = tl.program_id(1)
    off = (bh // heads) * s_b + (bh % heads) * s_h
    kv_rows = col * BN + tl.arange(0, BN)
    cols = tl.arange(0, BD)
    kv_mask = (kv_rows[:, None] < seq_b) & (cols[None, :] < dim)
    kk = tl.load(Kp + off + kv_rows[:, None] * s_r + cols[None, :], mask=kv_mask, other=0.0)
    vv = tl.load(Vp + off + kv_rows[:, None] * s_r + cols[None, :], mask=kv_mask, other=0.0)
    acc_k = tl.zeros([BN, BD], dtype=tl.float32)
    acc_v = tl.zeros([BN, BD], dtype=tl.float32)
    first = 0
    if MASKED:
        first = (col * BN // BM) * BM
    for r0 in range(first, seq_a, BM):
        rows = r0 + tl.arange(0, BM)
        row_mask = (rows[:, None] < seq_a) & (cols[None, :] < dim)
        qq = tl.load(Qp + off + rows[:, None] * s_r + cols[None, :], mask=row_mask, other=0.0)
        gg = tl.load(Gp + off + rows[:, None] * s_r + cols[None, :], mask=row_mask, other=0.0)
        ll = tl.load(Lp + bh * seq_a + rows, mask=rows < seq_a, other=float("inf"))
        dd = tl.load(Dp + bh * seq_a + rows, mask=rows < seq_a, other=0.0)
        sc = tl.dot(qq, tl.trans(kk)) * scale
        sc = tl.where(kv_rows[None, :] < seq_b, sc, float("-inf"))
        if MASKED:
            sc = tl.where(rows[:, None] >= kv_rows[None, :], sc, float("-inf"))
        pr = tl.exp(sc - ll[:, None])
        acc_v += tl.dot(tl.trans(pr.to(gg.dtype)), gg)
        dpr = tl.dot(gg, tl.trans(vv))
        dsc = pr * (dpr - dd[:, None])
        acc_k += tl.dot(tl.trans(dsc), qq)
        tl.atomic_add(DQp + off + rows[:, None] * s_r + cols[None, :], tl.dot(dsc, kk) * scale, mask=row_mask)
    tl.store(DVp + off + kv_rows[:, None] * s_r + cols[None, :], acc_v, mask=kv_mask)
    tl.store(DKp + off + kv_rows[:, None] * s_r + cols[None, :], acc_k * scale, mask=kv_mask)
'''

RENAMES = {"row_dot": "delta_pass", "grads": "attn_bwd", "Qp": "query", "Kp": "key", "Vp": "value", "Gp": "d_out",
           "Lp": "log_norm", "Dp": "row_terms", "DQp": "grad_q", "DKp": "grad_k", "DVp": "grad_v", "scale": "tau",
           "heads": "n_h", "seq_a": "len_q", "seq_b": "len_k", "dim": "hd", "MASKED": "CAUSAL_FLAG", "BM": "TILE_Q",
           "BN": "TILE_K", "BD": "TILE_D", "acc_k": "grad_key", "acc_v": "grad_val", "pr": "probs", "dsc": "dscore"}


def _lift_text(tmp_path: Path, text: str, name: str = "bwd.py") -> LiftReport:
    path = tmp_path / name
    path.write_text(text)
    return lift_file(path, Provenance("local", "0", name, 1, 1, "triton", ""), "local_triton")


def _renamed(text: str) -> str:
    return re.sub(r"\b(" + "|".join(RENAMES) + r")\b", lambda m: RENAMES[m.group(1)], text)


def _body(p) -> str:
    return print_program(p.program).split("\n", 1)[1]


def test_written_kernel_lifts_by_dataflow_and_renaming_changes_nothing(tmp_path):
    rep = _lift_text(tmp_path, KERNELS)
    progs = _backward(rep)
    assert sorted(progs) == ["local_triton_grads", "local_triton_grads_masked"], rep.skipped
    assert all(p.verified for p in progs.values())
    causal = progs["local_triton_grads_masked"]
    assert str(causal.program.mask_mod.body) == "q_idx >= kv_idx"
    renamed = _backward(_lift_text(tmp_path, _renamed(KERNELS), "renamed.py"))
    assert sorted(renamed) == ["local_triton_attn_bwd", "local_triton_attn_bwd_causal_flag"]
    assert _body(renamed["local_triton_attn_bwd_causal_flag"]) == _body(causal)
    assert _body(renamed["local_triton_attn_bwd"]) == _body(progs["local_triton_grads"])
    loops = [st for st in walk_stmts(causal.program.kernels[1].body) if isinstance(st, For)]
    assert [str(lp.hi) for lp in loops] == ["M"]  # the source's own loop bound


BROKEN = {
    "delta read from the lse": (("dd = tl.load(Dp + bh", "dd = tl.load(Lp + bh"), "subtracts the log-sum-exp"),
    "transposed dot": (("acc_v += tl.dot(tl.trans(pr.to(gg.dtype)), gg)", "acc_v += tl.dot(pr, gg)"), "contracts lane"),
    "delta of o * o": (("tl.sum(x * y, axis=1)", "tl.sum(x * x, axis=1)"), "computes delta"),
    "dk unscaled": (("acc_k * scale, mask", "acc_k, mask"), "dK is scaled by"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_backward_kernels_are_refused(tmp_path, case):
    (old, new), reason = BROKEN[case]
    assert old in KERNELS
    rep = _lift_text(tmp_path, KERNELS.replace(old, new))
    assert not _backward(rep)
    whys = [why for what, why in rep.skipped if what.startswith("grads")]
    assert whys and all(reason in why for why in whys), rep.skipped
