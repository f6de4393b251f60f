"""What the Triton and CUDA kernel generators share, below their statement dispatch.

Both generate one kernel body from one IR kernel, top to bottom: they emit indented lines, keep the IR names
visible at the current line as `Sym`s (dims, schedule constants and scalar params from the start; lets, loop
variables, grid axes and tiles as they are made), know the aux tensors expressions may load, and hold the
tiles made so far. The spelling (`ex`, the tile record, how a name becomes a local) is each lowering's own.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Generic, Iterable, Mapping, TypeVar

from kb.errors import KBError
from kb.ir.expr import Expr
from kb.ir.nodes import For, Init, Kernel, Let, Mask, Param, Program, Reduce, ScoreMod, serving_constructs, walk_stmts
from kb.lower.block_mask import BlockMaskPlan
from kb.lower.expr_context import AuxRef, ExprContext, ExprTarget, Kind, Sym, is_nonneg, visible_names

__all__ = ["KernelGenBase", "check_attention_params"]

TileT = TypeVar("TileT")


class KernelGenBase(Generic[TileT]):
    """Lines, names, aux tensors and tiles of one kernel being generated; `INDENT` is one level of indentation."""

    INDENT: ClassVar[str]

    def __init__(self, p: Program, k: Kernel, plan: BlockMaskPlan, dims: Iterable[str], scalars: Iterable[Param],
                 local: Callable[[str], str] = str) -> None:
        self.p, self.k, self.plan = p, k, plan
        self.lines: list[str] = []
        self.depth = 1
        self.names: dict[str, Sym] = visible_names(dims, scalars, local)
        self.aux: dict[str, AuxRef] = {}
        self.tiles: dict[str, TileT] = {}
        self.m_dim, self.n_dim = str(p.param("q").shape[2]), str(p.param("k").shape[2])

    def emit(self, line: str) -> None:
        self.lines.append(self.INDENT * self.depth + line)

    def ctx(self, names: Mapping[str, Sym] | None = None, aux: Mapping[str, AuxRef] | None = None) -> ExprContext:
        return ExprContext(ExprTarget.DEVICE, self.names if names is None else names, self.aux if aux is None else aux)

    def ex(self, e: Expr) -> str:
        """`e` as code in this lowering's spelling."""
        raise NotImplementedError

    def bind_scalar(self, name: str, e: Expr) -> str | None:
        """Compute `e` into the scalar `name` (a let, or an elementwise statement over no tile)."""
        raise NotImplementedError

    def s_let(self, st: Let) -> None:
        self.bind_scalar(st.name, st.value)

    def tile(self, ir_name: str) -> TileT:
        try:
            return self.tiles[ir_name]
        except KeyError:
            raise KBError(f"kernel {self.k.name}: tile {ir_name!r} is used before it is defined") from None

    def tensor_param(self, tensor: str, index: tuple) -> Param:
        """The param `tensor[index]` reads or writes; KBError for an unknown tensor or the wrong number of indices."""
        try:
            prm = self.p.param(tensor)
        except KeyError:
            raise KBError(f"kernel {self.k.name}: unknown tensor {tensor!r}") from None
        if len(index) != len(prm.shape):
            raise KBError(f"kernel {self.k.name}: {tensor} has {len(prm.shape)} dims, indexed with {len(index)}")
        return prm

    def loop_sym(self, st: For, code: str, below: str | None = None) -> Sym:
        """The symbol of loop `st`'s variable (as `code`): an int, >= 0 when the lower bound is."""
        return Sym(code, Kind.INT, is_nonneg(st.lo, self.ctx()), below)

    @staticmethod
    def check_order(st: For) -> None:
        if st.order not in ("forward", "reverse"):
            raise KBError(f"for {st.var}: unknown order {st.order!r} (forward or reverse)")

    @staticmethod
    def check_reduce(st: Reduce) -> None:
        if st.kind not in ("max", "sum"):
            raise KBError(f"reduce {st.out}: unknown reduction {st.kind!r} (max or sum)")

    def score_mod_body(self, st: ScoreMod) -> Expr:
        if self.p.score_mod is None:
            raise KBError(f"score_mod {st.tile}: the program has no score_mod; add `score_mod(...) = ...` or drop the statement")
        return self.p.score_mod.body

    def mask_mod_body(self, st: Mask) -> Expr:
        if self.p.mask_mod is None:
            raise KBError(f"mask {st.tile} mask_mod: the program has no mask_mod; add one or use `bounds`")
        return self.p.mask_mod.body


def check_attention_params(p: Program, lowering: str) -> None:
    """Both lowerings need q and k as [B, H, S, D] params and no varlen/paged index forms; KBError naming the lowering otherwise."""
    if constructs := serving_constructs(p):
        raise KBError(f"program {p.name}: the {lowering} lowering does not support {' or '.join(constructs)}; "
                      "lowering of varlen/paged programs is not supported yet (run them with kb.ir.interpret)")
    if any(isinstance(st, Init) and isinstance(st.fill, Expr) for k in p.kernels for st in walk_stmts(k.body)):
        raise KBError(f"program {p.name}: the {lowering} lowering does not support an init filled by an expression (attention sinks) yet")
    for name in ("q", "k"):
        try:
            prm = p.param(name)
        except KeyError:
            raise KBError(f"program {p.name}: the {lowering} lowering needs a param {name!r} [B, H, S, D]") from None
        if len(prm.shape) != 4:
            raise KBError(f"program {p.name}: {name} must be [B, H, S, D], got {prm.shape}")
