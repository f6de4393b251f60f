"""Designs for a target GPU come from the KB: measured sweeps of similar kernels first, then expert tunables."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from generate.backward import BackwardBuilt, _preferred, measured_structures, nondeterminism, run_to_run
from generate.candidate import CandidateFiles
from generate.designs import (LAYOUT_PENALTY, Sweep, backward_structure, default_designs, design_table, expert_designs, perf_similarity,
                              rank_designs, structure_scores)
from kb.errors import KBError
from kb.features import Features
from kb.ir.design import AUTO_SPLITS, Design, head_bucket, parse_design
from kb.ir.text import print_program
from kb.store import Kernel, PerfRecord, Tunable
from tests.support.ir_programs import backward
from tests.support.store import make_measured
from verify.result import Verdict

CAUSAL = Features(mask="causal", causal=True, head_dim=128)
DOC = Features(mask="document", head_dim=128)
DECODE = Features(mask="none", decode=True, split_kv=True, gqa_ratio=4, head_dim=128)
A, B, C = Design(128, 64, 4, 3), Design(128, 128, 8, 3), Design(64, 64, 4, 3)
FA2 = [("sm80", 128, {"block_m": 128, "block_n": 64, "num_warps": 4}),
       ("sm90", 128, {"block_m": 128, "block_n": 128, "kernel": "KernelCooperative"}),
       ("sm80", 128, {"block_m": 64, "block_n": 128, "num_warps": 4, "split_kv": True}),
       ("any", 0, {"block_m": 128, "block_n": 128, "num_warps": "num_warps"})]


def test_design_text_round_trips_and_bad_designs_are_refused() -> None:
    for d in (A, Design(16, 64, 4, 2, AUTO_SPLITS), Design(16, 128, 4, 2, 16, tma=False)):
        assert parse_design(str(d)) == d and Design.from_dict(d.to_dict()) == d
    assert str(Design(16, 64, 4, 2, AUTO_SPLITS)) == "16x64 w4 s2 split-auto"
    with pytest.raises(KBError, match="invalid design"):
        Design(96, 64, 4, 3)
    with pytest.raises(KBError, match="not a design"):
        parse_design("big and fast")
    assert head_bucket(64) == 64 and head_bucket(80) == 128 and head_bucket(8) == 16
    assert B.fits("sm90", 128) and not Design(128, 128, 8, 4).fits("sm80", 128)


def test_similarity_weighs_what_changes_the_best_design() -> None:
    assert perf_similarity(CAUSAL, CAUSAL) == pytest.approx(1.0)
    alibi = Features(mask="causal", causal=True, score_mod="alibi", alibi=True)
    assert perf_similarity(CAUSAL, alibi) > perf_similarity(CAUSAL, DOC) > perf_similarity(CAUSAL, DECODE)


def test_a_paged_kernels_own_sweeps_lead_and_dense_ones_only_follow() -> None:
    """Run 27: on a paged decode the dense decode sweeps' best tile (16x128) was not the paged sweeps' (16x64)."""
    paged = replace(DECODE, paged_kv=True)
    assert perf_similarity(DECODE, replace(DECODE, gqa_ratio=1)) == perf_similarity(paged, replace(paged, gqa_ratio=1))
    assert perf_similarity(paged, DECODE) == pytest.approx(1.0 - LAYOUT_PENALTY)
    wide, narrow = Design(16, 128, 4, 3, AUTO_SPLITS, pack_gqa=True), Design(16, 64, 4, 2, AUTO_SPLITS, pack_gqa=True)
    dense = [Sweep(f"d{i}", DECODE, "sm90", 128, ((wide, 1.0), (narrow, 1.1))) for i in range(4)]
    paged_sweep = Sweep("p1", replace(paged, gqa_ratio=8), "sm90", 128, ((wide, 1.1), (narrow, 1.0)))
    assert rank_designs(paged, "sm90", 128, [*dense, paged_sweep], FA2)[:2] == [narrow, wide]
    assert rank_designs(DECODE, "sm90", 128, [*dense, paged_sweep], FA2)[0] == wide
    assert rank_designs(paged, "sm90", 128, dense, FA2)[0] == wide  # no paged sweep: the dense ones still rank


def test_expert_tunables_map_onto_triton_designs() -> None:
    sm90 = expert_designs(FA2, "sm90", 128, decode=False)
    assert sm90[:2] == [Design(128, 128, 8, 3), Design(128, 64, 4, 3)]  # exact arch first; cooperative = 8 warps
    assert expert_designs(FA2, "sm80", 128, decode=False)[0] == Design(128, 64, 4, 2)
    assert expert_designs(FA2, "sm90", 128, decode=True) == [Design(16, 128, 4, 3, AUTO_SPLITS)]
    assert expert_designs(FA2, "sm90", 64, decode=False) == []


def test_measured_sweeps_of_the_nearest_class_lead() -> None:
    causal = Sweep("k1", CAUSAL, "sm90", 128, ((A, 1.0), (B, 0.8), (C, 1.2)))
    doc = Sweep("k2", DOC, "sm90", 128, ((A, 2.0), (C, 1.5)))
    other_arch = Sweep("k3", CAUSAL, "sm80", 128, ((C, 0.5),))
    ranked = rank_designs(CAUSAL, "sm90", 128, [causal, doc, other_arch], FA2)
    assert ranked[:3] == [B, A, C]
    assert rank_designs(DOC, "sm90", 128, [causal, doc], FA2)[0] == C
    off = rank_designs(CAUSAL, "sm90", 128, [causal, doc], FA2, memory=False)
    assert off[:2] == expert_designs(FA2, "sm90", 128, decode=False)[:2]  # memory off: expert order
    assert set(default_designs(False)) <= set(off)
    assert all(d.num_splits == AUTO_SPLITS or d.num_splits > 1 for d in rank_designs(DECODE, "sm90", 128, [], FA2))


def test_a_design_only_distant_sweeps_timed_follows_the_near_ones() -> None:
    """Two causal sweeps timed A and B; a document + softcap sweep (far) timed C fastest: C comes after A and B."""
    old = [Sweep(f"k{i}", CAUSAL, "sm90", 128, ((A, 1.0), (B, 1.1))) for i in range(2)]
    far = Sweep("k8", Features(mask="document", head_dim=128, softcap=True), "sm90", 128, ((C, 0.5), (A, 2.0)))
    assert rank_designs(CAUSAL, "sm90", 128, [*old, far], FA2)[:3] == [A, B, C]


def test_near_sweeps_decide_and_farther_ones_do_not_outvote_them() -> None:
    """The causal sweep puts B 1% ahead of A; five window sweeps (a class whose best tile differs) put A far ahead:
    B leads for a causal kernel, and a design only the window sweeps timed comes after the near sweep's designs."""
    window = Features(mask="sliding_window", causal=True, sliding_window=True, kv_span=101, head_dim=128)
    near = Sweep("k1", CAUSAL, "sm90", 128, ((A, 1.01), (B, 1.0)))
    far = [Sweep(f"w{i}", window, "sm90", 128, ((A, 1.0), (B, 1.3), (C, 0.9))) for i in range(5)]
    assert perf_similarity(CAUSAL, window) < perf_similarity(CAUSAL, CAUSAL)
    assert rank_designs(CAUSAL, "sm90", 128, [near, *far], FA2)[:3] == [B, A, C]


def test_a_learnable_tables_backward_is_not_ranked_by_its_frozen_twins_sweeps() -> None:
    frozen = replace(CAUSAL, score_mod="relative_bias", backward=True)
    learned = replace(frozen, learned_table=True)
    sweep = Sweep("k1", frozen, "sm90", 128, ((A, 1.0), (C, 0.5)))  # C won for the frozen table
    assert rank_designs(frozen, "sm90", 128, [sweep], FA2)[0] == C
    assert rank_designs(learned, "sm90", 128, [sweep], FA2)[0] != C  # its atomics change the best tile
    assert rank_designs(learned, "sm90", 128, [replace(sweep, features=learned)], FA2)[0] == C


def test_design_table_reads_measured_records_and_tunables(kb) -> None:
    kid = kb.write_kernel(Kernel(name="c", family="generated", origin="generated", ir_text="program c\n",
                                 features_json=CAUSAL.to_json(), head_dim=128))
    records = []
    for d, ms in ((A, 1.0), (B, 0.7)):
        r = make_measured(kid)
        r.arch, r.design_json, r.ms, r.shape_json = "sm90", json.dumps(d.to_dict()), ms, json.dumps({"D": 128})
        records.append(r)
    kb.write_perf(records)
    kb.write_tunables([Tunable(family="fa2_cuda", arch="sm80", head_dim=128, dtype="bf16",
                               params_json=json.dumps(FA2[0][2]))])
    table = design_table(kb, CAUSAL, ["sm90", "sm80"], [64, 128])
    assert table["sm90"][128][:2] == (B, A)
    assert table["sm80"][128][0] == Design(128, 64, 4, 2)
    assert design_table(kb, CAUSAL, ["sm90"], [128], memory=False)["sm90"][128][0] != B
    assert len(kb.list(PerfRecord)) == 2


def test_structures_are_compared_only_where_one_spec_was_timed_with_both() -> None:
    bwd = replace(CAUSAL, backward=True)
    case = ("spec-a", '{"D": 128}', "NVIDIA H100")
    atomics = Sweep("k-a", bwd, "sm90", 128, ((A, 2.0), (C, 1.5)), case, "dq atomics")  # its best: 1.5 ms
    dq_pass = Sweep("k-p", bwd, "sm90", 128, ((A, 1.2),), case, "dq pass")
    alone = Sweep("k-b", bwd, "sm90", 128, ((A, 0.1),), ("spec-b", '{"D": 128}', "NVIDIA H100"), "dq atomics")
    scores = structure_scores([atomics, dq_pass, alone], bwd)
    assert scores == {"dq pass": 1.0, "dq atomics": pytest.approx(1.2 / 1.5)}
    assert structure_scores([atomics, alone], bwd) == {}  # nothing timed both ways: retrieval's order stands
    on_h200 = replace(dq_pass, case=(*case[:2], "NVIDIA H200"))
    assert structure_scores([atomics, on_h200], bwd) == {}  # two GPUs are not one comparison
    learned = replace(bwd, score_mod="relative_bias", learned_table=True)
    assert structure_scores([atomics, dq_pass], learned) == {}  # frozen twins do not decide for a learned table
    # a structure's designs are ranked by its own sweeps: C won with atomic dq, A is all the dq pass measured
    assert rank_designs(bwd, "sm90", 128, [atomics, dq_pass], FA2, structure="dq atomics")[0] == C
    assert rank_designs(bwd, "sm90", 128, [atomics, dq_pass], FA2, structure="dq pass")[0] == A


def test_backward_structure_tells_atomic_dq_from_a_dq_pass() -> None:
    fa2 = backward("b_atomic", mask_mod="q_idx >= kv_idx")
    amd = backward("b_pass", mask_mod="q_idx >= kv_idx", dq_pass=("0", "N"))
    assert backward_structure(fa2) == "dq atomics" and nondeterminism(fa2)
    assert backward_structure(amd) == "dq pass" and nondeterminism(amd) is None


def test_measured_structures_read_backward_sweeps_from_the_kb(kb) -> None:
    bwd = replace(CAUSAL, backward=True)
    records = []
    for program, ms in ((backward("b_atomic", mask_mod="q_idx >= kv_idx"), 2.0),
                        (backward("b_pass", mask_mod="q_idx >= kv_idx", dq_pass=("0", "N")), 1.0)):
        kid = kb.write_kernel(Kernel(name=program.name, family="generated", origin="generated", head_dim=128,
                                     ir_text=print_program(program), features_json=bwd.to_json(), spec_hash="s1"))
        r = make_measured(kid)
        r.arch, r.design_json, r.ms, r.shape_json = "sm90", json.dumps(A.to_dict()), ms, json.dumps({"D": 128})
        records.append(r)
    assert measured_structures(kb, bwd) == {}  # no records yet
    kb.write_perf(records)
    assert measured_structures(kb, bwd) == {"dq pass": 1.0, "dq atomics": pytest.approx(0.5)}


def test_a_structure_leads_only_when_measured_clearly_faster() -> None:
    assert _preferred({"dq pass": 1.0, "dq atomics": 0.92}) == "dq pass"
    assert _preferred({"dq pass": 0.996, "dq atomics": 0.985}) is None  # within the spread of two calls
    assert _preferred({"dq atomics": 1.0}) is None and _preferred({}) is None


def test_run_to_run_names_every_source_of_run_to_run_differences(tmp_path: Path) -> None:
    """A dq-pass backward is reproducible only with its design fixed and without the `.cu`'s Hopper backward."""
    amd = backward("b_pass", mask_mod="q_idx >= kv_idx", dq_pass=("0", "N"))
    fa2 = backward("b_atomic", mask_mod="q_idx >= kv_idx")
    files = CandidateFiles(tmp_path / "c.py", tmp_path / "t.py", None)
    built = BackwardBuilt(amd, "r", "", files, Verdict.passed, "", timed_designs=False)
    assert run_to_run(built) is None
    assert run_to_run(replace(built, program=fa2)) == "dq_acc accumulated with atomics"
    hopper = run_to_run(replace(built, hopper_backward=True)) or ""
    assert hopper.startswith("the `.cu`'s Hopper backward")
    timed = run_to_run(replace(built, timed_designs=True)) or ""
    assert "--deterministic fixes the design" in timed
