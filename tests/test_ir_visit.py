"""One dispatch over statement kinds: a visitor covers every StmtOp or fails when its class is created."""

from __future__ import annotations

import pytest

from kb.errors import KBError
from kb.ir.interpret import _Machine
from kb.ir.nodes import BACKWARD_OPS, Let, StmtOp
from kb.ir.text import _Header
from kb.ir.validate import StmtRules
from kb.ir.visit import STMT_CLASSES, StmtVisitor, handler_name, stmt_op
from kb.lower import cuda, cuda_mma, cuda_sm90_ir
from kb.lower.triton_kernel import TritonKernelGen
from tests.support.ir_programs import causal_bwd

PRODUCTION = (_Header, StmtRules, _Machine, TritonKernelGen, cuda.CudaKernelGen, cuda_mma._MmaGen, cuda_sm90_ir._HookGen)


def _handlers(skip: StmtOp | None = None) -> dict[str, object]:
    """Class attributes handling every kind but `skip`."""
    return {handler_name(op): (lambda self, st: op.value) for op in StmtOp if op is not skip}


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_a_visitor_missing_a_kind_fails_at_class_creation() -> None:
    with pytest.raises(TypeError, match=r"handles no statement kind mask \(s_mask\)"):
        type("NoMask", (StmtVisitor,), _handlers(skip=StmtOp.MASK))


def test_a_rejected_kind_needs_a_reason_and_no_handler() -> None:
    with pytest.raises(TypeError, match="without saying why"):
        type("Quiet", (StmtVisitor,), {**_handlers(skip=StmtOp.PROBS), "rejects": frozenset({StmtOp.PROBS})})
    with pytest.raises(TypeError, match="both handles and rejects probs"):
        type("Both", (StmtVisitor,), {**_handlers(), "rejects": frozenset({StmtOp.PROBS}), "rejects_why": "no"})


def test_a_rejected_kind_raises_at_run_time() -> None:
    fwd = type("Fwd", (StmtVisitor,), {**_handlers(skip=StmtOp.LET), "rejects": frozenset({StmtOp.LET}),
                                       "rejects_why": "lets are not welcome here"})
    with pytest.raises(KBError, match="`let` statement: lets are not welcome here"):
        fwd().visit(Let("x", None))  # type: ignore[arg-type]


def test_visit_dispatches_on_the_kind_and_passes_arguments() -> None:
    echo = type("Echo", (StmtVisitor,), {**_handlers(), "s_let": lambda self, st, extra: (st.name, extra)})
    assert echo().visit(Let("x", None), 7) == ("x", 7)  # type: ignore[arg-type]


def test_a_non_statement_is_a_kb_error() -> None:
    with pytest.raises(KBError, match="unknown statement kind int"):
        _Header().visit(3)  # type: ignore[arg-type]
    with pytest.raises(KBError, match="unknown statement kind str"):
        stmt_op("let")


def test_every_kind_has_a_node_class_and_a_handler_name() -> None:
    assert set(STMT_CLASSES) == set(StmtOp)
    assert len({handler_name(op) for op in StmtOp}) == len(StmtOp)


# collected at import, before the tests above make their own visitors: the production ones and any other subclass
@pytest.mark.parametrize("cls", sorted({*PRODUCTION, *_subclasses(StmtVisitor)}, key=lambda c: f"{c.__module__}.{c.__qualname__}"),
                         ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_production_visitors_cover_every_kind(cls: type[StmtVisitor]) -> None:
    handled = {op for op in StmtOp if callable(getattr(cls, handler_name(op), None))}
    assert handled | cls.rejects == set(StmtOp) and not handled & cls.rejects
    assert cls.rejects <= BACKWARD_OPS  # only forward-only lowerings opt out, and only of backward statements


def test_the_cuda_lowering_rejects_a_backward_program_by_name() -> None:
    with pytest.raises(KBError, match="`probs` statement: the CUDA lowerings are forward-only"):
        cuda.lower_program(causal_bwd())
