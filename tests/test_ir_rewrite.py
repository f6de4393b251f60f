"""kb.ir.rewrite: one post-order walk over nested bodies; rewrites replace, splice or drop statements."""

from __future__ import annotations

from dataclasses import replace

from kb.ir.nodes import Elementwise, For, IfBlock, Init, Load, Mask, Stmt, walk_stmts
from kb.ir.rewrite import StmtTransformer, map_kernels, map_stmts, without_tests
from kb.ir.text import parse_program, print_program
from kb.ir.validate import validate
from tests.support.ir_programs import FIXTURES


def test_every_statement_is_seen_after_its_nested_bodies() -> None:
    body = FIXTURES["document"]().kernels[0].body  # a KV loop holding a block test
    seen: list[Stmt] = []
    assert map_stmts(body, lambda st: seen.append(st) or st) == body  # the identity rewrite keeps the body
    assert sorted(map(id, seen)) == sorted(map(id, walk_stmts(body)))  # every statement once
    loop = next(st for st in seen if isinstance(st, For))
    assert all(seen.index(inner) < seen.index(loop) for inner in loop.body)  # post-order
    assert any(isinstance(st, IfBlock) for st in walk_stmts(loop.body))


def test_a_rewrite_replaces_splices_and_drops() -> None:
    p = FIXTURES["document"]()

    def rewrite(st: Stmt) -> Stmt | tuple[Stmt, ...]:
        if isinstance(st, Mask):
            return ()  # dropped, also inside the block test
        if isinstance(st, Load) and st.tensor == "k":
            return (st, Elementwise("k_again", st.index[0]))  # spliced after it
        return st

    q = map_kernels(p, rewrite)
    assert not any(isinstance(st, Mask) for k in q.kernels for st in walk_stmts(k.body))
    loads = [i for i, st in enumerate(walk_stmts(q.kernels[0].body)) if isinstance(st, Load) and st.tensor == "k"]
    flat = list(walk_stmts(q.kernels[0].body))
    assert loads and all(isinstance(flat[i + 1], Elementwise) and flat[i + 1].out == "k_again" for i in loads)
    assert print_program(map_kernels(p, lambda st: st)) == print_program(p)


def test_a_transformer_overrides_only_the_kinds_it_changes() -> None:
    class Widen(StmtTransformer):
        def s_init(self, st: Init) -> Stmt:
            return replace(st, shape=tuple("HEAD_PAD_V" if d == "HEAD_PAD" else d for d in st.shape))

    p = FIXTURES["causal"]()
    body = Widen().rewrite(p.kernels[0].body)
    inits = [st for st in walk_stmts(body) if isinstance(st, Init)]
    assert any("HEAD_PAD_V" in st.shape for st in inits)
    assert [type(st) for st in walk_stmts(body)] == [type(st) for st in walk_stmts(p.kernels[0].body)]
    validate(parse_program(print_program(p)))  # the fixture itself is untouched


def test_without_tests_flattens_block_tests_and_drops_the_variant() -> None:
    loop = next(st for st in FIXTURES["document"]().kernels[0].body if isinstance(st, For))
    flat = without_tests(loop.body, (Mask,))
    assert not any(isinstance(st, (Mask, IfBlock)) for st in flat)
    kept = [st for st in walk_stmts(loop.body) if not isinstance(st, (Mask, IfBlock))]
    assert list(flat) == kept  # the same statements, in order (this loop nests no other loop)
