"""The kernel IR: nodes, expressions, text form, validation, content hash, features.

Import-light: importing `kb.ir` loads no torch (the interpreter, evaluation and
classification modules import it on use).
"""

from kb.ir.expr import Expr, ExprOp, parse_expr, print_expr
from kb.ir.features import derive_features
from kb.ir.nodes import (
    MASK_MOD_PARAMS, SCHEDULE_CONSTANTS, SCORE_MOD_PARAMS, BlockClass, Combine, Dot, Dtype,
    Elementwise, Finalize, For, Full, Gather, GridAxis, IfBlock, Index, Init, Kernel, Let, Load, Mask,
    OnlineSoftmax, Param, Program, Reduce, Role, Schedule, ScoreMod, Span, Stmt, StmtOp, Store,
    VariantFn,
)
from kb.ir.text import content_hash, parse_program, print_program
from kb.ir.validate import Problem, problems, validate

__all__ = [
    "Expr", "ExprOp", "parse_expr", "print_expr",
    "Dtype", "Role", "Param", "Schedule", "GridAxis", "VariantFn", "Span", "Full", "Gather", "Index",
    "StmtOp", "BlockClass", "Let", "Load", "Store", "Init", "Dot", "Elementwise", "Reduce",
    "ScoreMod", "Mask", "OnlineSoftmax", "Finalize", "Combine", "For", "IfBlock", "Stmt",
    "Kernel", "Program", "SCORE_MOD_PARAMS", "MASK_MOD_PARAMS", "SCHEDULE_CONSTANTS",
    "print_program", "parse_program", "content_hash", "validate", "problems", "Problem",
    "derive_features",
]
