"""Names of a Program, and renaming them: the pass that keeps a transferred program's names apart.

A transfer merges two programs' names: the reference's (its kernels' tiles, scalars, loop and grid
variables, scratch buffers) and the target's (the spec's aux tensors and scalars, the gradients the
backward adds). `names(p)` is every name `p` uses; `fresh(base, taken)` a name outside `taken`;
`keep_apart(p, claimed)` renames p's own names (kernel names and scratch buffers) that `claimed` holds;
`rename(p, mapping)` renames params, grid axes, statement operands, and the variables and loaded tensors
of every expression (variant functions' own parameters are never renamed; dims and schedule constants
are not names a mapping may hold). A mapping must be collision-free: its new names outside `names(p)`.
"""

from __future__ import annotations

import keyword
from dataclasses import replace
from typing import Mapping

from kb.ir.expr import Expr, ExprOp, walk
from kb.ir.nodes import (
    AuxGrad, Combine, Dot, Elementwise, Finalize, For, Full, Gather, IfBlock, Index, Init, Let, Load, Mask,
    OnlineSoftmax, Probs, Program, Reduce, Role, ScoreMod, ScoreModGrad, SoftmaxGrad, Span, Stmt, Store, TileAt, VariantFn,
    SCHEDULE_CONSTANTS, SCORE_MOD_PARAMS, walk_stmts,
)
from kb.ir.visit import StmtVisitor

__all__ = ["names", "local_names", "fresh", "rename", "keep_apart"]


def names(p: Program) -> frozenset[str]:
    """Every name `p` uses: params, dims, schedule constants, variant parameters (score, b, h, q_idx, kv_idx, whether
    or not `p` has a variant) and every kernel name."""
    out = {q.name for q in p.params} | set(p.dims()) | set(SCHEDULE_CONSTANTS) | set(SCORE_MOD_PARAMS) | local_names(p)
    for fn in (p.score_mod, p.mask_mod):
        if fn is not None:
            out |= set(fn.params) | _expr_names(fn.body)
    return frozenset(out)


def local_names(p: Program) -> frozenset[str]:
    """Names the kernels define: grid axes, lets, loop and lane variables, tiles."""
    out: set[str] = set()
    for k in p.kernels:
        out |= {ax.name for ax in k.grid}
        for st in walk_stmts(k.body):
            out |= _Defined().visit(st)
    return frozenset(out)


def fresh(base: str, taken: frozenset[str] | set[str]) -> str:
    """`base`, or `base_1`, `base_2`, ... : the first not in `taken` (nor a Python keyword: `def` for an aux `ef`)."""
    name, i = base, 1
    while name in taken or keyword.iskeyword(name):
        name, i = f"{base}_{i}", i + 1
    return name


def keep_apart(p: Program, claimed: frozenset[str] | set[str]) -> Program:
    """`p` with its own names (tiles, scalars, loop and grid variables, scratch buffers) that are in `claimed`
    renamed to fresh ones: a transfer's reference before the target's aux tensors and scalars join it."""
    own = local_names(p) | {q.name for q in p.params if q.role is Role.SCRATCH}
    taken = set(names(p) | set(claimed))
    mapping: dict[str, str] = {}
    for n in sorted(own & set(claimed)):
        mapping[n] = fresh(n, taken)
        taken.add(mapping[n])
    return rename(p, mapping)


def rename(p: Program, mapping: Mapping[str, str]) -> Program:
    """`p` with every name in `mapping` replaced."""
    if not mapping:
        return p
    r = _Renamer(mapping)
    return replace(
        p, params=tuple(replace(q, name=r.n(q.name)) for q in p.params),
        kernels=tuple(replace(k, grid=tuple(replace(ax, name=r.n(ax.name), extent=r.e(ax.extent)) for ax in k.grid),
                              body=r.body(k.body)) for k in p.kernels),
        score_mod=_variant(p.score_mod, r), mask_mod=_variant(p.mask_mod, r))


def _variant(fn: VariantFn | None, r: "_Renamer") -> VariantFn | None:
    if fn is None:
        return None
    own = _Renamer({k: v for k, v in r.mapping.items() if k not in fn.params})
    return replace(fn, body=own.e(fn.body))


def _expr_names(e: Expr) -> set[str]:
    return {str(n.value) for n in walk(e) if n.op in (ExprOp.VAR, ExprOp.LOAD)}


class _Defined(StmtVisitor[set[str]]):
    """The names one statement defines (nested bodies are walked by the caller)."""

    def s_let(self, st: Let) -> set[str]:
        return {st.name}

    def s_load(self, st: Load) -> set[str]:
        return {st.out} | {ix.var for ix in st.index if isinstance(ix, Gather)}

    def s_store(self, st: Store) -> set[str]:
        return {ix.var for ix in st.index if isinstance(ix, Gather)}

    def s_init(self, st: Init) -> set[str]:
        return {st.out}

    def s_dot(self, st: Dot) -> set[str]:
        return {st.out}

    def s_elementwise(self, st: Elementwise) -> set[str]:
        return {st.out}

    def s_reduce(self, st: Reduce) -> set[str]:
        return {st.out}

    def s_scoremod(self, st: ScoreMod) -> set[str]:
        return set()

    def s_mask(self, st: Mask) -> set[str]:
        return set()

    def s_onlinesoftmax(self, st: OnlineSoftmax) -> set[str]:
        return {st.m, st.l, st.acc}

    def s_finalize(self, st: Finalize) -> set[str]:
        return {st.o, st.lse}

    def s_combine(self, st: Combine) -> set[str]:
        return {st.o, st.lse}

    def s_for(self, st: For) -> set[str]:
        return {st.var}

    def s_ifblock(self, st: IfBlock) -> set[str]:
        return set()

    def s_probs(self, st: Probs) -> set[str]:
        return {st.out}

    def s_softmaxgrad(self, st: SoftmaxGrad) -> set[str]:
        return {st.out}

    def s_scoremodgrad(self, st: ScoreModGrad) -> set[str]:
        return set()

    def s_auxgrad(self, st: AuxGrad) -> set[str]:
        return set()


class _Renamer(StmtVisitor[Stmt]):
    def __init__(self, mapping: Mapping[str, str]) -> None:
        self.mapping = dict(mapping)

    def n(self, name: str) -> str:
        return self.mapping.get(name, name)

    def e(self, e: Expr) -> Expr:
        if e.op in (ExprOp.VAR, ExprOp.LOAD) and isinstance(e.value, str):
            return Expr(e.op, tuple(self.e(a) for a in e.args), self.n(e.value))
        return Expr(e.op, tuple(self.e(a) for a in e.args), e.value) if e.args else e

    def at(self, at: TileAt) -> TileAt:
        return TileAt(self.e(at.b), self.e(at.h), self.e(at.q_start), self.e(at.kv_start), at.head_rows)

    def ix(self, ix: Index) -> Index:
        if isinstance(ix, Expr):
            return self.e(ix)
        if isinstance(ix, Span):
            return replace(ix, start=self.e(ix.start), until=None if ix.until is None else self.e(ix.until))
        if isinstance(ix, Gather):
            return replace(ix, var=self.n(ix.var), index=self.e(ix.index),
                           valid=None if ix.valid is None else self.e(ix.valid))
        assert isinstance(ix, Full)
        return ix

    def body(self, body: tuple[Stmt, ...]) -> tuple[Stmt, ...]:
        return tuple(self.visit(st) for st in body)

    def s_let(self, st: Let) -> Stmt:
        return Let(self.n(st.name), self.e(st.value))

    def s_load(self, st: Load) -> Stmt:
        return replace(st, out=self.n(st.out), tensor=self.n(st.tensor), index=tuple(self.ix(i) for i in st.index))

    def s_store(self, st: Store) -> Stmt:
        return replace(st, tensor=self.n(st.tensor), index=tuple(self.ix(i) for i in st.index), value=self.n(st.value))

    def s_init(self, st: Init) -> Stmt:
        return replace(st, out=self.n(st.out), fill=self.e(st.fill) if isinstance(st.fill, Expr) else st.fill)

    def s_dot(self, st: Dot) -> Stmt:
        return replace(st, out=self.n(st.out), a=self.n(st.a), b=self.n(st.b))

    def s_elementwise(self, st: Elementwise) -> Stmt:
        return Elementwise(self.n(st.out), self.e(st.value))

    def s_reduce(self, st: Reduce) -> Stmt:
        return replace(st, out=self.n(st.out), src=self.n(st.src))

    def s_scoremod(self, st: ScoreMod) -> Stmt:
        return ScoreMod(self.n(st.tile), self.at(st.at))

    def s_mask(self, st: Mask) -> Stmt:
        return replace(st, tile=self.n(st.tile), at=self.at(st.at))

    def s_onlinesoftmax(self, st: OnlineSoftmax) -> Stmt:
        return OnlineSoftmax(*(self.n(x) for x in (st.m, st.l, st.acc, st.scores, st.values)))

    def s_finalize(self, st: Finalize) -> Stmt:
        return Finalize(*(self.n(x) for x in (st.o, st.lse, st.m, st.l, st.acc)))

    def s_combine(self, st: Combine) -> Stmt:
        return Combine(*(self.n(x) for x in (st.o, st.lse, st.o_parts, st.lse_parts)))

    def s_for(self, st: For) -> Stmt:
        return replace(st, var=self.n(st.var), lo=self.e(st.lo), hi=self.e(st.hi), body=self.body(st.body))

    def s_ifblock(self, st: IfBlock) -> Stmt:
        return replace(st, at=self.at(st.at), then=self.body(st.then), orelse=self.body(st.orelse))

    def s_probs(self, st: Probs) -> Stmt:
        return Probs(self.n(st.out), self.n(st.scores), self.n(st.lse))

    def s_softmaxgrad(self, st: SoftmaxGrad) -> Stmt:
        return SoftmaxGrad(self.n(st.out), self.n(st.p), self.n(st.dp), self.n(st.delta))

    def s_scoremodgrad(self, st: ScoreModGrad) -> Stmt:
        return ScoreModGrad(self.n(st.tile), self.n(st.scores), self.at(st.at))

    def s_auxgrad(self, st: AuxGrad) -> Stmt:
        return AuxGrad(self.n(st.grad), self.n(st.aux), self.n(st.tile), self.n(st.scores), self.at(st.at),
                       None if st.lse is None else self.n(st.lse))
