"""bench.design_ranking: leave-one-spec-out reads the held-out sweep's own speed at the rule's first pick."""

from __future__ import annotations

from bench.design_ranking import leave_one_out, variant
from generate.designs import Sweep, _ranked_by_sweeps
from kb.features import Features
from kb.ir.design import Design

CAUSAL = Features(mask="causal", causal=True, head_dim=128)
A, B, C = Design(128, 64, 4, 3), Design(128, 128, 8, 3), Design(64, 64, 4, 3)


def test_leave_one_out_scores_the_first_pick_in_the_left_out_sweep() -> None:
    sweeps = [Sweep("k1", CAUSAL, "sm90", 128, ((A, 1.0), (B, 2.0), (C, 3.0)), ("s1", "{}", "H100")),
              Sweep("k2", CAUSAL, "sm90", 128, ((A, 2.0), (B, 1.0), (C, 3.0)), ("s2", "{}", "H100"))]
    # each sweep's pick comes from the other sweep: k1 gets B (2x its best), k2 gets A (2x its best)
    for rule in (_ranked_by_sweeps, variant(0.0, True), variant(0.5, False)):
        assert sorted(leave_one_out(sweeps, rule, backward=False)) == [0.5, 0.5]
    assert leave_one_out(sweeps, _ranked_by_sweeps, backward=True) == []


def test_the_fastest_of_the_first_k_picks_reads_what_a_module_timing_its_listed_designs_gets() -> None:
    """k1's ranking from k2 is A, B, C (k1's times 2, 1, 3): the fastest of the first two is B, its best; k2's is B, A."""
    sweeps = [Sweep("k1", CAUSAL, "sm90", 128, ((A, 2.0), (B, 1.0), (C, 3.0)), ("s1", "{}", "H100")),
              Sweep("k2", CAUSAL, "sm90", 128, ((A, 1.0), (B, 2.0), (C, 3.0)), ("s2", "{}", "H100"))]
    assert sorted(leave_one_out(sweeps, _ranked_by_sweeps, backward=False)) == [0.5, 0.5]
    assert leave_one_out(sweeps, _ranked_by_sweeps, backward=False, first=2) == [1.0, 1.0]
