"""Transfer into a reference with two KV loops (the AMD Triton forward: its full KV blocks, then the padded last
one): every loop applies the target's variants, and a strategy whose first loop covers the whole KV range
drops the second loop, which would otherwise count the last block's keys twice."""

from __future__ import annotations

from dataclasses import replace

import pytest

from generate.attempts import check_program
from generate.spec import load_spec
from generate.target import target_for
from generate.transfer import Strategy, transfer
from kb.ir.expr import parse_expr
from kb.ir.nodes import BlockClass, For, IfBlock, Mask, OnlineSoftmax, Program, walk_stmts
from kb.ir.validate import validate
from tests.support.ir_programs import plain
from tests.support.repo import REPO

SPEC = REPO / "bench" / "heldout" / "document_ids_1d.py"  # a document mask at S=227: the last KV block is ragged


def _two_loops() -> Program:
    """plain() with its KV loop split as the AMD kernel splits it: full blocks, then the rest."""
    k = plain().kernels[0]
    loop = next(st for st in k.body if isinstance(st, For))
    full = parse_expr("N // BLOCK_N * BLOCK_N")
    body: list = []
    for st in k.body:
        body += [replace(loop, hi=full), replace(loop, lo=full)] if st is loop else [st]
    return replace(plain(), kernels=(replace(k, body=tuple(body)),))


@pytest.mark.parametrize("strategy", list(Strategy), ids=lambda s: s.value)
def test_every_kv_loop_is_transferred_once(strategy: Strategy) -> None:
    spec = load_spec(SPEC)
    program = transfer(_two_loops(), target_for(spec), strategy)
    validate(program)
    loops = [st for st in program.kernels[0].body if isinstance(st, For) and
             any(isinstance(s, OnlineSoftmax) for s in walk_stmts(st.body))]
    assert len(loops) == (2 if strategy is Strategy.REUSE else 1)
    for loop in loops:  # each applies the document mask, not only the reference's bounds
        assert any(isinstance(s, Mask) and s.use_mask_mod for s in walk_stmts(loop.body))
    assert check_program(program, spec) is None


def test_reuse_keeps_the_references_block_tests() -> None:
    """REUSE keeps a block-class reference's tests: dropped, its full KV range ran every tile masked (run 20: the
    held-out constant prefix-LM's `.cu` 2.7x slower than from BLOCK_MASK)."""
    spec = load_spec(REPO / "examples" / "specs" / "prefix_lm.py")
    reference = transfer(plain(), target_for(spec), Strategy.BLOCK_MASK)  # a kernel generated the FlexAttention way

    def tests(p: Program) -> list[tuple[BlockClass, str]]:
        return [(st.cls, type(st.then[0]).__name__) for st in walk_stmts(p.kernels[0].body) if isinstance(st, IfBlock)]

    program = transfer(reference, target_for(spec), Strategy.REUSE)
    assert tests(program) == tests(reference) == [(BlockClass.EMPTY, "Load"), (BlockClass.FULL, "Mask")]
    assert check_program(program, spec) is None
