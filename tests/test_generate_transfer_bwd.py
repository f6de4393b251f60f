"""Backward transfer: the forward's variant slots go into a backward reference (the FA2 structure:
KV-outer, dq accumulated), and the interpreted gradients match autograd of the spec, per variant class."""

from __future__ import annotations

from pathlib import Path

import pytest

from generate.check_backward import check_backward_program
from generate.spec import load_spec
from generate.target import target_for
from generate.transfer import Strategy, transfer
from generate.transfer_bwd import backward_target, transfer_backward
from kb.errors import KBError
from kb.ir.nodes import AuxGrad, ScoreModGrad, walk_stmts
from kb.ir.text import parse_program, print_program
from kb.ir.validate import validate
from tests.test_ir_backward import backward_text

SPECS = Path(__file__).parent / "data" / "specs"
GOLDEN = Path(__file__).parent / "golden" / "ir"
# the causal FA2 backward structure (what ingest lifts from flash_attn_triton.py's _bwd_kernel)
REFERENCE = parse_program(backward_text("fa2_bwd_causal", mask_mod="q_idx >= kv_idx", m_lo="n_start // BLOCK_M * BLOCK_M"))

CLASSES = {
    "causal": "causal_where_d128.py",
    "sliding_window": "sliding_window_32.py",
    "alibi": "alibi_causal.py",
    "softcap_gqa": "softcap_causal_gqa.py",
    "document": "document_causal.py",
    "prefix_lm": "prefix_lm_16.py",
    "gqa": "causal_gqa4_interleave.py",
    "relative_bias_learnable": "relative_bias_table.py",
}


def _programs(spec_file: str):
    spec = load_spec(SPECS / spec_file)
    fwd = transfer(parse_program((GOLDEN / "causal.kbir").read_text()), target_for(spec), Strategy.BLOCK_MASK, name="fwd")
    learnable = tuple(e.aux for e in spec.state if e.parameter and e.aux)
    target = backward_target(fwd, learnable, (spec.shapes.M, spec.shapes.N))
    bwd = transfer_backward(REFERENCE, target, name="bwd")
    validate(bwd)
    return spec, fwd, bwd, target


@pytest.mark.parametrize("cls", sorted(CLASSES))
def test_transferred_backward_matches_autograd(cls: str) -> None:
    spec, fwd, bwd, target = _programs(CLASSES[cls])
    assert parse_program(print_program(bwd)) == bwd
    assert check_backward_program(bwd, fwd, spec, target.learnable) is None


def test_learnable_table_gets_an_aux_grad_and_score_mods_their_derivative() -> None:
    _, _, bwd, target = _programs(CLASSES["relative_bias_learnable"])
    assert target.learnable and any(isinstance(st, AuxGrad) for k in bwd.kernels for st in walk_stmts(k.body))
    _, _, bwd, _ = _programs(CLASSES["softcap_gqa"])
    assert any(isinstance(st, ScoreModGrad) for k in bwd.kernels for st in walk_stmts(k.body))


def test_causal_backward_skips_blocks_above_the_diagonal() -> None:
    spec, fwd, bwd, _ = _programs(CLASSES["causal"])
    text = print_program(bwd)
    assert "for m_start in range(maximum(0, n_start // BLOCK_M * BLOCK_M), M, BLOCK_M)" in text, text


def test_a_forward_program_is_refused_as_a_backward_reference() -> None:
    spec, fwd, _, target = _programs(CLASSES["causal"])
    with pytest.raises(KBError, match="not a backward program"):
        transfer_backward(fwd, target, name="x")


def test_a_generated_backward_with_a_table_gradient_serves_as_a_reference_for_another_variant() -> None:
    """Write-back makes generated backwards references; a table's gradient belongs to its own spec only."""
    _, _, with_table, _ = _programs(CLASSES["relative_bias_learnable"])
    spec, fwd, _, _ = _programs(CLASSES["softcap_gqa"])
    target = backward_target(fwd, (), (spec.shapes.M, spec.shapes.N))
    bwd = transfer_backward(with_table, target, name="bwd")
    validate(bwd)
    assert not any(isinstance(st, AuxGrad) for k in bwd.kernels for st in walk_stmts(k.body))
    assert check_backward_program(bwd, fwd, spec) is None
