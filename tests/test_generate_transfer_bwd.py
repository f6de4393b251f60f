"""Backward transfer: the forward's variant slots go into a backward reference (the FA2 structure:
KV-outer, dq accumulated), and the interpreted gradients match autograd of the spec, per variant class."""

from __future__ import annotations


import pytest

from generate.check_backward import check_backward_program
from generate.transfer_bwd import backward_target, transfer_backward
from kb.errors import KBError
from kb.ir.nodes import AuxGrad, ScoreModGrad, walk_stmts
from kb.ir.text import parse_program, print_program
from kb.ir.validate import validate
from tests.support.backward import CLASSES, transferred_programs

@pytest.mark.parametrize("cls", sorted(CLASSES))
def test_transferred_backward_matches_autograd(cls: str) -> None:
    spec, fwd, bwd, target = transferred_programs(CLASSES[cls])
    assert parse_program(print_program(bwd)) == bwd
    assert check_backward_program(bwd, fwd, spec, target.learnable) is None


def test_learnable_table_gets_an_aux_grad_and_score_mods_their_derivative() -> None:
    _, _, bwd, target = transferred_programs(CLASSES["relative_bias_learnable"])
    assert target.learnable and any(isinstance(st, AuxGrad) for k in bwd.kernels for st in walk_stmts(k.body))
    _, _, bwd, _ = transferred_programs(CLASSES["softcap_gqa"])
    assert any(isinstance(st, ScoreModGrad) for k in bwd.kernels for st in walk_stmts(k.body))


def test_causal_backward_skips_blocks_above_the_diagonal() -> None:
    spec, fwd, bwd, _ = transferred_programs(CLASSES["causal"])
    text = print_program(bwd)
    assert "for m_start in range(maximum(0, n_start // BLOCK_M * BLOCK_M), M, BLOCK_M)" in text, text


def test_a_forward_program_is_refused_as_a_backward_reference() -> None:
    spec, fwd, _, target = transferred_programs(CLASSES["causal"])
    with pytest.raises(KBError, match="not a backward program"):
        transfer_backward(fwd, target, name="x")


def test_a_generated_backward_with_a_table_gradient_serves_as_a_reference_for_another_variant() -> None:
    """Write-back makes generated backwards references; a table's gradient belongs to its own spec only."""
    _, _, with_table, _ = transferred_programs(CLASSES["relative_bias_learnable"])
    spec, fwd, _, _ = transferred_programs(CLASSES["softcap_gqa"])
    target = backward_target(fwd, (), (spec.shapes.M, spec.shapes.N))
    bwd = transfer_backward(with_table, target, name="bwd")
    validate(bwd)
    assert not any(isinstance(st, AuxGrad) for k in bwd.kernels for st in walk_stmts(k.body))
    assert check_backward_program(bwd, fwd, spec) is None
