"""A kernel that walks a GQA group in a loop, one query head after another, launched per query head instead.

A backward program for GQA/MQA runs its dq pass over KV heads (grid axis `hk: Hkv`), each program looping over the
`Hq // Hkv` query heads of its group: `for h in range(hk * (Hq // Hkv), (hk + 1) * (Hq // Hkv), 1)`. When nothing
crosses that loop's iterations (only `let`s before it, nothing after it, every store inside indexed by `h` without
accumulating), the iterations are independent programs: `spread_group_loops` puts `h: Hq` in the grid in `hk`'s
place and binds `let hk = h // (Hq // Hkv)`. The results are the same stores; the launch has `Hq // Hkv` times more
programs (MQA at B=8, 4K, 128-row tiles: 256 programs of 16 heads each on 132 SMs become 4096 of one head).
Kernels that sum over the group (dK, dV) keep their loop: their store is after it.
"""

from __future__ import annotations

from dataclasses import replace

from kb.ir.expr import Expr, free_vars, parse_expr, var
from kb.ir.nodes import For, GridAxis, Kernel, Let, Program, Store, index_exprs, walk_stmts

__all__ = ["spread_group_loops", "spread_kernel"]


def _group_loop(k: Kernel, axis: str) -> For | None:
    """The kernel's group loop over `axis`'s query heads, when every statement before it is a `let` not reading the
    loop's variable and it is the last statement."""
    *head, last = k.body
    if not isinstance(last, For) or not all(isinstance(st, Let) for st in head):
        return None
    lo, hi = parse_expr(f"{axis} * (Hq // Hkv)"), parse_expr(f"({axis} + 1) * (Hq // Hkv)")
    if (last.lo, last.hi, last.step, last.order) != (lo, hi, 1, "forward") or any(
            last.var in free_vars(st.value) for st in head if isinstance(st, Let)):
        return None
    return last


def _independent(loop: For) -> bool:
    """Every store of the loop writes where its head variable says (a plain store indexed by it): no iteration reads or
    adds to another's output."""
    stores = [st for st in walk_stmts(loop.body) if isinstance(st, Store)]
    return bool(stores) and all(not st.accumulate and any(loop.var in free_vars(e) for e in index_exprs(st))
                                for st in stores)


def spread_kernel(k: Kernel) -> Kernel:
    """`k` launched per query head where it walks a GQA group with independent iterations; else `k` itself."""
    axes = [ax for ax in k.grid if ax.extent == var("Hkv")]
    if len(axes) != 1:
        return k
    axis = axes[0].name
    loop = _group_loop(k, axis)
    if loop is None or not _independent(loop) or any(ax.name == loop.var for ax in k.grid):
        return k
    grid = tuple(GridAxis(loop.var, var("Hq")) if ax.name == axis else ax for ax in k.grid)
    kv_head: Expr = parse_expr(f"{loop.var} // (Hq // Hkv)")
    return replace(k, grid=grid, body=(Let(axis, kv_head), *k.body[:-1], *loop.body))


def spread_group_loops(p: Program) -> Program:
    """`p` with each kernel that walks a GQA group one head at a time launched per query head (module docstring)."""
    kernels = tuple(spread_kernel(k) for k in p.kernels)
    return p if all(a is b for a, b in zip(kernels, p.kernels)) else replace(p, kernels=kernels)
