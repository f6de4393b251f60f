"""Spelling Triton / Python source text: dtype names, float constants, parenthesisation, broadcast suffixes."""

from __future__ import annotations

import re

from kb.ir.nodes import Dtype

__all__ = ["LOG2E", "NEG_INF", "TL_DTYPE", "TORCH_DTYPE", "float_code", "strip_parens", "wrap", "load_other", "bcast"]

LOG2E = "1.4426950408889634"
NEG_INF = 'float("-inf")'
TL_DTYPE = {Dtype.F32: "tl.float32", Dtype.BF16: "tl.bfloat16", Dtype.F16: "tl.float16",
             Dtype.I32: "tl.int32", Dtype.I64: "tl.int64", Dtype.BOOL: "tl.int1"}
TORCH_DTYPE = {Dtype.F32: "torch.float32", Dtype.BF16: "torch.bfloat16", Dtype.F16: "torch.float16",
                Dtype.I32: "torch.int32", Dtype.I64: "torch.int64", Dtype.BOOL: "torch.bool"}

def float_code(x: float) -> str:
    """A float constant as Triton / Python source (infinities as float(...))."""
    if x == float("-inf"):
        return NEG_INF
    return 'float("inf")' if x == float("inf") else repr(float(x))


def strip_parens(code: str) -> str:
    """Drop one pair of redundant outer parentheses."""
    if code.startswith("(") and code.endswith(")"):
        depth = 0
        for i, ch in enumerate(code):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and i < len(code) - 1:
                return code
        return code[1:-1]
    return code


def wrap(code: str) -> str:
    """Parenthesise unless `code` is atomic or already one parenthesised group."""
    atomic = re.fullmatch(r"[\w.]+", code) or (code.startswith("(") and strip_parens(code) != code)
    return code if atomic else f"({code})"


def load_other(mask: str | None, other: str) -> str:
    """`other` for a tl.load under `mask`; a mask that is None when EVEN_D / EVEN_DV holds gets None there too
    (tl.load refuses `other` without a mask)."""
    flag = re.match(r"\(None if (EVEN_DV?) ", mask or "")
    return f"(None if {flag.group(1)} else {other})" if flag else other


def bcast(pos: int, rank: int) -> str:
    if rank == 1:
        return ""
    return "[" + ", ".join(":" if i == pos else "None" for i in range(rank)) + "]"
