"""One dispatch over statement kinds: `StmtVisitor` maps every `StmtOp` to a handler method.

Invariant: every concrete visitor class covers every `StmtOp` — it has the handler method
`handler_name(op)` (`s_` + the node class name in lower case: `s_let`, `s_scoremod`, `s_ifblock`)
or lists the kind in its `rejects` set, with `rejects_why` saying why. This is checked when the
class is created, so a new statement kind (a new `StmtOp` member and node class in `kb.ir.nodes`)
fails at import in every visitor not yet taught it, before any program runs; a rejected kind
raises `KBError` naming the kind and the reason when a program reaches it. Handlers are
inherited, so a subclass overrides only the kinds it treats differently.

`visit(st, *args)` calls the handler with `st` and any extra arguments and returns its result;
an object that is no IR statement raises `KBError`.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Generic, TypeVar, get_args

from kb.errors import KBError
from kb.ir.nodes import Stmt, StmtOp

__all__ = ["StmtVisitor", "handler_name", "stmt_op", "STMT_CLASSES"]

R = TypeVar("R")

STMT_CLASSES: dict[StmtOp, type] = {cls.op: cls for cls in get_args(Stmt)}  # the node class of each kind
assert set(STMT_CLASSES) == set(StmtOp), "kb.ir.nodes: `Stmt` must list one node class per StmtOp"


def handler_name(op: StmtOp) -> str:
    """The method a visitor handles `op` with: `s_` + the node class name in lower case."""
    return "s_" + STMT_CLASSES[op].__name__.lower()


def stmt_op(st: object) -> StmtOp:
    """The kind of `st`; KBError when `st` is no IR statement node."""
    op = getattr(type(st), "op", None)
    if not isinstance(op, StmtOp) or STMT_CLASSES[op] is not type(st):
        known = ", ".join(cls.__name__ for cls in STMT_CLASSES.values())
        raise KBError(f"unknown statement kind {type(st).__name__}; known: {known}")
    return op


class StmtVisitor(Generic[R]):
    """Base of every per-statement-kind dispatch (printer, validator, interpreter, lowerings)."""

    rejects: ClassVar[frozenset[StmtOp]] = frozenset()  # kinds this visitor refuses at run time
    rejects_why: ClassVar[str] = ""  # the reason, shown with the rejected kind
    _table: ClassVar[dict[StmtOp, Callable[..., Any]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [op for op in StmtOp if op not in cls.rejects and not callable(getattr(cls, handler_name(op), None))]
        if missing:
            wanted = ", ".join(f"{op.value} ({handler_name(op)})" for op in missing)
            raise TypeError(f"{cls.__qualname__} handles no statement kind {wanted}; "
                            "add the method, or list the kind in `rejects` with a reason in `rejects_why`")
        both = [op.value for op in cls.rejects if callable(getattr(cls, handler_name(op), None))]
        if both:
            raise TypeError(f"{cls.__qualname__} both handles and rejects {', '.join(both)}")
        if cls.rejects and not cls.rejects_why:
            raise TypeError(f"{cls.__qualname__} rejects {', '.join(op.value for op in cls.rejects)} "
                            "without saying why (`rejects_why`)")
        cls._table = {op: cls._reject if op in cls.rejects else getattr(cls, handler_name(op)) for op in StmtOp}

    def visit(self, st: Stmt, *args: Any) -> R:
        try:
            handler = self._table[st.op]
        except (AttributeError, KeyError):
            stmt_op(st)  # raises the KBError naming what `st` is
            raise
        return handler(self, st, *args)

    def _reject(self, st: Stmt, *args: Any) -> R:
        raise KBError(f"`{st.op.value}` statement: {self.rejects_why}")
