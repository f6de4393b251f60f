"""Serving layouts in the Triton lowering: what sets a varlen/paged program apart and how its pieces are lowered.

A program is a *serving* program when its q or k is not a dense [B, H, S, D] tensor (token-major [T, H, D], 3-D
decode [B, Hq, D], a 4-D paged cache [NUM_PAGES, PAGE, Hkv, D], a token pool [POOL, Hkv, D]) or when it uses an
index form only serving layouts need (`until`, a gathered axis). Such a program is lowered by the same generator as
a dense one (kb.lower.triton_kernel); this module holds the few places it differs:
- bounds: the built-in `kv_idx < N` of `mask` exists only when the program has a dim named N (the interpreter's
  rule, kb.ir.nodes); a token-major or paged program's per-sequence bound is its mask_mod or its loads;
- options: the speed transformations that read dims M / N or a dense layout are off (`serving_options`): the block
  lists (they bound tiles by N), GQA packing (rows of several query heads), and, except over packed token-major
  sequences, the closed-form KV-loop split and tensor descriptors (a descriptor cannot express a gather);
- what is not lowered yet (`serving_refusals`): block-class tests (`if block(...)`: their closed forms and the host
  table bound tiles by M / N), split-KV grids (the host's split count reads N) and backward programs;
- gathered axes: `clamped_index` rewrites a lane index so that an invalid lane's table loads read in range;
- layout sizes: an integer scalar that divides in an index (a page size) is compiled in (`layout_scalars`).
The module's host side runs the designs generation chose where any tiles compute the same (`free_tiles`: every lane
finds its own page), a split-KV program's split count then chosen at launch from the grid, the SM count and the
table's key capacity (`key_capacity`); else its own schedule (`OWN_DESIGN_CHOOSER`): a program whose BLOCK_N is its
page size computes something else at another tile.
"""

from __future__ import annotations

import dataclasses
from string import Template

from kb.ir.expr import Expr, ExprOp, call, const, var, walk
from kb.ir.nodes import For, IfBlock, Let, Load, Program, Role, Store, index_exprs, is_backward, serving_constructs, walk_stmts
from kb.ir.window import window_width
from kb.lower.expr_context import DTYPE_KIND, Kind
from kb.lower.triton_options import LowerOptions

__all__ = ["is_serving", "serving_refusals", "serving_options", "kv_bound", "clamped_index", "layout_scalars",
           "free_tiles", "key_capacity", "split_kv_blocks", "OWN_DESIGN_CHOOSER", "own_design_lines"]

OWN_DESIGN_CHOOSER = "_own_design"


def is_serving(p: Program) -> bool:
    """Does `p` use a serving layout: q or k not 4-D, or a varlen/paged index form (`until`, a gathered axis)?"""
    try:
        dense = len(p.param("q").shape) == 4 and len(p.param("k").shape) == 4
    except KeyError:
        return False  # check_attention_params names the missing param
    return not dense or bool(serving_constructs(p))


def serving_refusals(p: Program) -> list[str]:
    """What the Triton lowering cannot lower yet in serving program `p`, one phrase each (empty: it lowers); in
    place of kb.lower.kernel_gen.check_attention_params, which refuses every serving layout."""
    out: list[str] = []
    if is_backward(p):
        out.append("a backward program")
    if any(isinstance(st, IfBlock) for k in p.kernels for st in walk_stmts(k.body)):
        out.append("block-class tests (`if block(...)`: their closed forms and the host table bound tiles by M and N; "
                   "bound the KV loop instead)")
    return out


def serving_options(opts: LowerOptions, p: Program) -> LowerOptions:
    """`opts` without the transformations that assume a dense layout (see the module docstring). The closed-form
    KV-loop split stays where q and k are token-major ([M, Hq, D], [N, Hkv, D]: packed sequences): its full blocks
    lie inside [0, N), and the mask_mod's own bounds (a sequence's causal diagonal and its end) place them per
    sequence, so interior blocks run without mask code as a dense program's do. Tensor descriptors stay there too:
    a descriptor per head over the packed [tokens, D] slice whose row extent is the span's `until` (the sequence's
    end), so TMA's zero fill and store clipping are the masked form's bounds (kb.lower.triton_tiles.tma_desc)."""
    packed = len(p.param("q").shape) == 3 and len(p.param("k").shape) == 3 and {"M", "N"} <= set(p.dims())
    return dataclasses.replace(opts, split_kv_loop=opts.split_kv_loop and packed, indexed_kv_loop=False,
                               tma=opts.tma and packed, warp_specialize=False, pack_gqa=False)


def layout_scalars(p: Program) -> tuple[str, ...]:
    """The integer scalars `p`'s loads and stores divide an index by (`//`, `%`): the page size of a paged cache. The
    kernels take them as constexprs, compiled in: an engine runs one page size, and a division by a known power of
    two is a shift where a runtime divisor is an integer division per lane (the held-out GQA ALiBi decode's split
    kernel for sm_90: 3776 SASS instructions with a runtime page size, 2608 with it compiled in)."""
    ints = {q.name for q in p.params if q.role is Role.SCALAR and DTYPE_KIND[q.dtype] is Kind.INT}
    found: dict[str, None] = {}
    for k in p.kernels:
        for st in walk_stmts(k.body):
            if isinstance(st, (Load, Store)):
                for e in index_exprs(st):
                    for n in walk(e):
                        if n.op in (ExprOp.FLOORDIV, ExprOp.MOD) and n.args[1].op is ExprOp.VAR and n.args[1].value in ints:
                            found[str(n.args[1].value)] = None
    return tuple(q.name for q in p.params if q.name in found)


def _address_exprs(st: object) -> tuple[Expr, ...]:
    """The expressions an address is made of in statement `st`: a load's or store's indices, a let's value, a loop's
    bounds."""
    if isinstance(st, (Load, Store)):
        return tuple(index_exprs(st))
    if isinstance(st, Let):
        return (st.value,)
    return (st.lo, st.hi) if isinstance(st, For) else ()


def _index_nodes(p: Program) -> list[Expr]:
    """Every expression node of `p`'s addresses (`_address_exprs`)."""
    return [n for k in p.kernels for st in walk_stmts(k.body) for e in _address_exprs(st) for n in walk(e)]


def _by_tile(e: Expr) -> bool:
    """Does `e` divide by a tile side (`// BLOCK_N`, `% BLOCK_M`)?"""
    return any(n.op in (ExprOp.FLOORDIV, ExprOp.MOD) and n.args[1].op is ExprOp.VAR
               and n.args[1].value in ("BLOCK_M", "BLOCK_N") for n in walk(e))


def free_tiles(p: Program) -> bool:
    """Can `p` run any design's tiles and compute the same: no address divides by a tile side (BLOCK_M, BLOCK_N: a
    program whose tile is one page of the cache, `block_table[b, n_start // BLOCK_N]`), so each lane finds its own
    page and a tile may span several pages or part of one (the serving verifier re-pages the cache at 1 and 64
    tokens per page). A loop bound aligned to a tile (a window's first block) is no address; a table read is."""
    for k in p.kernels:
        for st in walk_stmts(k.body):
            exprs = _address_exprs(st)
            if isinstance(st, (Load, Store)) and any(_by_tile(e) for e in exprs):
                return False
            if any(n.op is ExprOp.LOAD and any(_by_tile(a) for a in n.args) for e in exprs for n in walk(e)):
                return False
    return True


def key_capacity(p: Program) -> str | None:
    """The most keys one sequence can hold, as host code: the width of the page (or token) table the loads gather
    through, times the page size where an index divides by one; None without such a table."""
    tables = {str(n.value) for n in _index_nodes(p) if n.op is ExprOp.LOAD}
    ints = [q for q in p.params if q.name in tables and q.role is Role.AUX and len(q.shape) == 2
            and DTYPE_KIND[q.dtype] is Kind.INT]
    if len(ints) != 1:
        return None
    width, pages, k = str(ints[0].shape[1]), layout_scalars(p), p.param("k").shape
    if pages:
        return f"{width} * {pages[0]}"
    return f"{width} * {k[1]}" if len(k) == 4 else width  # a [NUM_PAGES, PAGE, Hkv, D] cache: pages of PAGE keys


def split_kv_blocks(p: Program) -> str | None:
    """The KV blocks the launch-time split rule divides among a serving program's splits, as host code: a window of
    constant width W (`kb.ir.window`) is cdiv(W, BLOCK_N) + 1 blocks whatever the context (the rule then keeps each
    split 4 blocks long, as the transfer caps the program's own schedule), else what the page table can hold; None
    when neither is known."""
    if p.mask_mod is not None:
        for q in p.params:
            if q.role is Role.AUX and len(q.shape) == 1 and DTYPE_KIND[q.dtype] is Kind.INT:
                width = window_width(p.mask_mod.body, q.name)
                if width is not None:
                    return f"_hcdiv({width}, BLOCK_N) + 1"
    capacity = key_capacity(p)
    return f"_hcdiv({capacity}, BLOCK_N)" if capacity else None


def kv_bound(p: Program) -> str | None:
    """The dim `mask` bounds kv_idx by: N when `p` has one, else None (no built-in bound)."""
    return "N" if "N" in p.dims() else None


def clamped_index(index: Expr, valid: str) -> Expr:
    """A gathered lane's `index` with every table load's indices replaced by `where(valid, i, 0)` (`valid` a name
    bound to the lanes' validity): an invalid lane reads the table at 0, which the load's own bounds test still
    guards, so no lane ever reads a table out of range (the IR clamps such loads; their value is never used)."""
    if not index.args:
        return index
    args = tuple(clamped_index(a, valid) for a in index.args)
    if index.op is ExprOp.LOAD:
        args = tuple(call("where", var(valid), a, const(0))
 if a.op is not ExprOp.CONST else a
                     for a in args)
    return Expr(index.op, args, index.value)


_OWN_DESIGN = Template('''\
PROGRAM = ${program}
# A varlen/paged module lists no designs (DESIGNS stays empty) and runs its program's own schedule everywhere: its
# BLOCK_N may be a page of the cache, so another design's tiles could change what it computes.
# (BLOCK_M, BLOCK_N, NUM_SPLITS, num_warps, num_stages, tma, pack_gqa); GQA packing: not used, ${packing}
DESIGNS = {}
PROGRAM_DESIGN = ${own}


def ${chooser}(t, D, key, launch):
    """The program's own schedule, whatever the GPU and shape (nothing to choose, nothing timed)."""
    return PROGRAM_DESIGN

''')


def own_design_lines(p: Program, packing: str) -> list[str]:
    """A serving module's constants (PROGRAM, an empty DESIGNS, PROGRAM_DESIGN: the schedule as it is, a BLOCK_N
    below 16 included) and the chooser its host function calls instead of the design table's."""
    s = p.schedule
    own = (s.block_m, s.block_n, s.num_splits, s.num_warps, s.num_stages, False, False)
    return _OWN_DESIGN.substitute(program=repr(p.name), packing=packing, own=repr(own), chooser=OWN_DESIGN_CHOOSER).split("\n")
