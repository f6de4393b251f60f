"""A separate value head dim: `with_value_dim(p)` gives v, o and o partials their own last dim `Dv`.

MLA-style attention has value heads of another width than query/key heads (D_qk = 192,
D_v = 128). The IR expresses it in the one model it has: the tensors holding values end in
`Dv` instead of `D`, and the tiles built from them (the online-softmax accumulator, the
finalized or combined output) are HEAD_PAD_V wide instead of HEAD_PAD. The pass is a plain
`Program -> Program`:
- value tensors: those loaded into a tile that an `online_softmax` multiplies by (`@ vt`);
- output tensors: every out or scratch param whose last dim is `D` (the attention output and
  its split-KV partials; the LSE ends in M);
- accumulators: `init` of an `online_softmax` accumulator, HEAD_PAD -> HEAD_PAD_V.
A program that already has `Dv` is returned unchanged; `validate` checks the result.
`without_value_dim` is the inverse (one head dim D again), so a transfer from a reference with
value heads to a spec without them gives the program such a spec has always had.
"""

from __future__ import annotations

from dataclasses import replace

from kb.ir.nodes import (
    Init, Load, OnlineSoftmax, Param, Program, Role, Stmt, Store, VALUE_DIM, walk_stmts,
)
from kb.ir.rewrite import map_stmts

__all__ = ["with_value_dim", "without_value_dim", "has_value_dim", "backward_with_value_dim"]

_BACKWARD_VALUES = ("v", "o", "dout", "dv")  # a backward program's tensors of value width (dq_acc stays q's)


def has_value_dim(p: Program) -> bool:
    """Does `p` declare a value head dim `Dv` of its own?"""
    return VALUE_DIM in p.dims()


def with_value_dim(p: Program) -> Program:
    """`p` with v/o/o-partials ending in `Dv` and HEAD_PAD_V-wide accumulators (see the module docstring)."""
    if has_value_dim(p):
        return p
    stmts = [st for k in p.kernels for st in walk_stmts(k.body)]
    value_tiles = {st.values for st in stmts if isinstance(st, OnlineSoftmax)}
    values = {st.tensor for st in stmts if isinstance(st, Load) and st.out in value_tiles}
    accs = frozenset(st.acc for st in stmts if isinstance(st, OnlineSoftmax))
    params = tuple(_value_param(prm, values) for prm in p.params)
    kernels = tuple(replace(k, body=_pads(k.body, "HEAD_PAD", "HEAD_PAD_V", accs)) for k in p.kernels)
    return replace(p, params=params, kernels=kernels)


def backward_with_value_dim(p: Program) -> Program:
    """Backward program `p` for value heads of their own width: v, o, dO and dV end in `Dv`, and the tiles stored to
    dV are initialised HEAD_PAD_V wide; P, dP and dS stay [BLOCK_M, BLOCK_N], so dP = dO V^T contracts over Dv and
    dQ, dK over D as before."""
    if has_value_dim(p):
        return p
    params = tuple(replace(prm, shape=prm.shape[:-1] + (VALUE_DIM,))
                   if prm.name in _BACKWARD_VALUES and prm.shape and prm.shape[-1] == "D" else prm for prm in p.params)
    stored = frozenset(st.value for k in p.kernels for st in walk_stmts(k.body) if isinstance(st, Store) and st.tensor == "dv")
    kernels = tuple(replace(k, body=_pads(k.body, "HEAD_PAD", "HEAD_PAD_V", stored)) for k in p.kernels)
    return replace(p, params=params, kernels=kernels)


def without_value_dim(p: Program) -> Program:
    """`p` with one head dim: every `Dv` becomes `D` and every HEAD_PAD_V tile HEAD_PAD."""
    if not has_value_dim(p):
        return p
    params = tuple(replace(prm, shape=tuple("D" if d == VALUE_DIM else d for d in prm.shape)) for prm in p.params)
    kernels = tuple(replace(k, body=_pads(k.body, "HEAD_PAD_V", "HEAD_PAD", None)) for k in p.kernels)
    return replace(p, params=params, kernels=kernels)


def _value_param(prm: Param, values: set[str]) -> Param:
    written = prm.role in (Role.OUT, Role.SCRATCH)
    if prm.shape and prm.shape[-1] == "D" and (written or prm.name in values):
        return replace(prm, shape=prm.shape[:-1] + (VALUE_DIM,))
    return prm


def _pads(body: tuple[Stmt, ...], old: str, new: str, inits: frozenset[str] | None) -> tuple[Stmt, ...]:
    """`body` with `old` -> `new` in the shapes of the `init`s named in `inits` (None: every init)."""
    def pad(st: Stmt) -> Stmt:
        if isinstance(st, Init) and (inits is None or st.out in inits):
            return replace(st, shape=tuple(new if d == old else d for d in st.shape))
        return st

    return map_stmts(body, pad)
