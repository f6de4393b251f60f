"""Rewriting IR bodies, one way: nested bodies (For, IfBlock) are handled here once, not by each pass.

`map_stmts(body, fn)` calls `fn` on every statement after its nested bodies were rewritten (post-order) and puts what
`fn` returns in its place: the statement itself, another one, several (a tuple, spliced in) or none (an empty tuple).
`map_kernels(p, fn)` does that to every kernel of a program. `StmtTransformer` is the same walk as a visitor: every
statement kind comes back unchanged until a subclass overrides its handler (`s_load`, `s_init`, ...), and
`transformer.rewrite(body)` applies it. The read-only walk is `kb.ir.nodes.walk_stmts` (pre-order).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Union

from kb.ir.nodes import For, IfBlock, Program, Stmt, StmtOp
from kb.ir.visit import StmtVisitor, handler_name

__all__ = ["Rewritten", "map_stmts", "map_kernels", "StmtTransformer", "without_tests"]

Rewritten = Union[Stmt, tuple[Stmt, ...]]  # what a rewrite gives for one statement: it, another, several or none


def map_stmts(body: tuple[Stmt, ...], fn: Callable[[Stmt], Rewritten]) -> tuple[Stmt, ...]:
    """`body` with `fn` applied post-order to every statement (see the module docstring)."""
    out: list[Stmt] = []
    for st in body:
        if isinstance(st, For):
            inner = map_stmts(st.body, fn)
            st = st if _same_stmts(inner, st.body) else replace(st, body=inner)
        elif isinstance(st, IfBlock):
            then, orelse = map_stmts(st.then, fn), map_stmts(st.orelse, fn)
            st = st if _same_stmts(then, st.then) and _same_stmts(orelse, st.orelse) else replace(st, then=then, orelse=orelse)
        new = fn(st)
        out.extend(new if isinstance(new, tuple) else (new,))
    return tuple(out)


def _same_stmts(a: tuple[Stmt, ...], b: tuple[Stmt, ...]) -> bool:
    """The same statement objects: an unchanged body keeps its node (identity rewrites allocate nothing)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def map_kernels(p: Program, fn: Callable[[Stmt], Rewritten]) -> Program:
    """`p` with every kernel body rewritten by `map_stmts(body, fn)`."""
    return replace(p, kernels=tuple(replace(k, body=map_stmts(k.body, fn)) for k in p.kernels))


def without_tests(body: tuple[Stmt, ...], drop: tuple[type, ...]) -> tuple[Stmt, ...]:
    """`body`'s own statements (loops are not entered) with each block test replaced by its `then` statements, and
    without the statement kinds in `drop`: a transfer's view of a tile body before it applies its variant again."""
    out: list[Stmt] = []
    for st in body:
        if isinstance(st, drop):
            continue
        if isinstance(st, IfBlock):
            out += without_tests(st.then, drop)
            continue
        out.append(st)
    return tuple(out)


def _same(self: object, st: Stmt) -> Rewritten:
    return st


# every handler the identity: a transformer overrides only the kinds it changes
_Identity = type("_Identity", (), {handler_name(op): _same for op in StmtOp})


class StmtTransformer(_Identity, StmtVisitor[Rewritten]):  # type: ignore[misc, valid-type]
    """A rewrite as a visitor over statement kinds (see the module docstring)."""

    def rewrite(self, body: tuple[Stmt, ...]) -> tuple[Stmt, ...]:
        return map_stmts(body, self.visit)
