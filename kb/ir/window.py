"""Sliding windows read off a decode's mask: the first key a query can see, and a window's constant width.

A paged decode's query sits at its sequence's last position; a mask term `kv_idx > E` (or `>=`, or the mirrored
`E < kv_idx`) with E free of kv_idx bounds the keys from below. generate.transfer_serving starts the KV loop there
(`first_key`) and caps a windowed program's split count by its width; the Triton lowering sizes the launch-time
split rule by the same width (`window_width`), so a window of W keys is split as its cdiv(W, BLOCK_N) + 1 KV blocks
whatever the context.
"""

from __future__ import annotations

import functools

from kb.ir.algebra import conjuncts, normal_form
from kb.ir.expr import Expr, ExprOp, call, const, free_vars, load, substitute, var
from kb.ir.nodes import TileAt

__all__ = ["first_key", "window_width"]


def first_key(mask: Expr | None, at: TileAt) -> Expr | None:
    """The first key a decode query can see, from the mask's `kv_idx > E` / `kv_idx >= E` terms (E free of kv_idx,
    at the tile's batch and head, q_idx 0 in the decode view), or None. Keys below it are masked, so a loop that
    starts there visits a sliding window's keys only, not the whole sequence. A grouped tile's rows differ in head:
    a bound that reads h is left to the mask."""
    if mask is None:
        return None
    starts: list[Expr] = []
    for t in conjuncts(mask):
        if t.op in (ExprOp.GT, ExprOp.GE) and t.args[0] == var("kv_idx"):
            e, strict = t.args[1], t.op is ExprOp.GT
        elif t.op in (ExprOp.LT, ExprOp.LE) and t.args[1] == var("kv_idx"):
            e, strict = t.args[0], t.op is ExprOp.LT
        else:
            continue
        if "kv_idx" in free_vars(e) or (at.head_rows and "h" in free_vars(e)):
            continue
        e = substitute(e, {"b": at.b, "h": at.h, "q_idx": const(0)})
        starts.append(e + 1 if strict else e)
    if not starts:
        return None
    return functools.reduce(lambda a, e: call("maximum", a, e), starts)


def window_width(mask: Expr | None, lengths: str) -> int | None:
    """How many keys a decode query sees when the mask bounds them to a window of constant width below the
    sequence's length `lengths[b]`; None for no such window."""
    first = first_key(mask, TileAt(var("b"), var("h"), const(0), const(0)))
    width = normal_form(load(lengths, var("b")) - first) if first is not None else None
    if width is None or not (width.op is ExprOp.CONST and isinstance(width.value, int)):
        return None
    return width.value
