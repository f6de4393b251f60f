"""Program names and renaming (kb.ir.rename): every name a program uses, fresh names, a rename that keeps meaning."""

from __future__ import annotations

import torch

from kb.ir.interpret import run_program
from kb.ir.nodes import Role
from kb.ir.rename import fresh, keep_apart, local_names, names, rename
from kb.ir.text import parse_program, print_program
from kb.ir.validate import validate
from tests.support.ir_programs import backward_text

BWD = parse_program(backward_text("bwd", mask_mod="q_idx >= kv_idx", m_lo="n_start // BLOCK_M * BLOCK_M"))


def test_names_cover_params_dims_and_kernel_names() -> None:
    every = names(BWD)
    assert {"q", "lse", "delta", "dq_acc", "B", "M", "BLOCK_M", "score", "kv_idx"} <= every
    assert {"dt", "s", "p", "ds", "m_start", "hk", "kt"} <= local_names(BWD) <= every
    assert "delta" not in local_names(BWD)  # a param, not a kernel name


def test_fresh_avoids_taken_names_and_keywords() -> None:
    assert fresh("dt", {"x"}) == "dt"
    assert fresh("dt", {"dt", "dt_1"}) == "dt_2"
    assert fresh("def", set()) == "def_1"  # an aux `ef` would have a keyword for its gradient


def test_rename_round_trips_and_keeps_meaning() -> None:
    mapping = {"dt": "dt_1", "s": "s_1", "delta": "delta_1", "m_start": "m_start_1", "hk": "hk_1"}
    renamed = rename(BWD, mapping)
    validate(renamed)
    text = print_program(renamed)
    assert "reduce dt_1 = sum(og, 1)" in text and "softmax_grad ds = p * (dp - dt_1)" in text
    assert "param delta_1: [B, Hq, M] f32 scratch" in text and " delta[" not in text
    assert rename(renamed, {v: k for k, v in mapping.items()}) == BWD
    g = torch.Generator().manual_seed(0)
    ins = {n: torch.randn(1, 2, 24, 8, generator=g) for n in ("q", "k", "v", "o", "dout")}
    ins |= {"lse": torch.randn(1, 2, 24, generator=g), "sm_scale": 0.3}
    want, got = run_program(BWD, ins), run_program(renamed, ins)
    for n in ("dq", "dk", "dv"):
        assert torch.equal(want[n], got[n]), n


def test_keep_apart_renames_only_the_programs_own_names() -> None:
    apart = keep_apart(BWD, {"dt", "delta", "q", "sm_scale", "B"})
    own = local_names(apart) | {p.name for p in apart.params if p.role is Role.SCRATCH}
    assert not own & {"dt", "delta"}
    assert {"q", "sm_scale", "B"} <= names(apart)  # interface names and dims are never the program's own
    validate(apart)
