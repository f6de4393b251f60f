"""Serving regions of a Triton attention kernel, found by dataflow: page tables, varlen offsets, split combines.

Serving kernels (vLLM, SGLang) address their tiles indirectly. Whether or not a kernel lifts into a
complete Program, these regions are what a transfer to a paged or varlen spec needs, so they become
snippets with their source lines. They are told apart by how values flow, never by names:
- an *attention load* is a `tl.load` whose value reaches a `tl.dot` operand (q, k, v tiles);
- a *table load* is a `tl.load` whose value reaches the pointer of an attention load. Read under a
  loop variable it is a page table or a token pool (paged KV); read once per program it is a
  per-sequence start offset (varlen);
- a *length load* is a `tl.load` whose value bounds a loop (`range(...)` argument) without
  addressing anything: the sequence length of a varlen batch;
- a *combine kernel* has no `tl.dot` (nor a reduced product), reads partial results and merges them
  with a maximum and `exp`/`exp2` of a difference: the split-KV (flash-decoding) reduction or a
  merge of two attention states.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TypeGuard

__all__ = ["Region", "serving_regions"]


@dataclass(frozen=True)
class Region:
    kind: str  # a snippet kind: "paged_kv", "varlen" or "split_kv_combine"
    title: str
    ir_text: str
    start: int
    end: int
    features: tuple[tuple[str, bool], ...]


@dataclass(frozen=True)
class _Load:
    target: str
    pointer: frozenset[str]  # names the pointer expression reads
    line: int
    end: int
    loop_vars: frozenset[str]  # loop variables of the loops around it


def _names(node: ast.AST | None) -> frozenset[str]:
    return frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name)) if node is not None else frozenset()


def _value_names(node: ast.AST) -> frozenset[str]:
    """Names whose *values* flow into `node`: a load's pointer and mask, and a where's condition, do not."""
    if isinstance(node, ast.Call) and (_is_call(node, "load") or _is_call(node, "where")):
        kept = node.args[1:] if _is_call(node, "where") else []
        kept += [kw.value for kw in node.keywords if kw.arg not in ("mask", "other", "boundary_check")]
        return frozenset().union(*(_value_names(a) for a in kept)) if kept else frozenset()
    if isinstance(node, ast.Name):
        return frozenset({node.id})
    return frozenset().union(*(_value_names(c) for c in ast.iter_child_nodes(node)))


def _is_call(node: ast.AST, suffix: str) -> TypeGuard[ast.Call]:
    return isinstance(node, ast.Call) and ast.unparse(node.func).endswith(suffix)


class _Flow(ast.NodeVisitor):
    """Assignments (name -> names read), loads, dot operands and loop bounds of one function."""

    def __init__(self) -> None:
        self.deps: dict[str, set[str]] = {}  # every name an assignment reads (address flow)
        self.value_deps: dict[str, set[str]] = {}  # without load pointers/masks and where-conditions
        self.loads: list[_Load] = []
        self.dot_operands: set[str] = set()
        self.bounds: set[str] = set()
        self.loops: list[str] = []
        self.has_dot = False
        self.exp_of_diff = False
        self.maximum = False

    def visit_For(self, node: ast.For) -> None:
        if isinstance(node.iter, ast.Call):
            for arg in node.iter.args:
                self.bounds |= _names(arg)
        loop_var = node.target.id if isinstance(node.target, ast.Name) else ""
        self.loops.append(loop_var)
        for st in node.body + node.orelse:
            self.visit(st)
        self.loops.pop()

    def _assign(self, targets: list[ast.expr], value: ast.AST, line: int, end: int) -> None:
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        for name in names:
            self.deps.setdefault(name, set()).update(_names(value))
            self.value_deps.setdefault(name, set()).update(_value_names(value))
        for call in (n for n in ast.walk(value) if _is_call(n, "load")):
            pointer = _names(call.args[0]) if call.args else frozenset()
            for name in names:
                self.loads.append(_Load(name, pointer, line, end, frozenset(v for v in self.loops if v)))

    def visit_Assign(self, node: ast.Assign) -> None:
        self._assign(node.targets, node.value, node.lineno, node.end_lineno or node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._assign([node.target], node.value, node.lineno, node.end_lineno or node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._assign([node.target], node.value, node.lineno, node.end_lineno or node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if _is_call(node, "dot"):
            self.has_dot = True
            for arg in node.args[:2]:
                self.dot_operands |= _value_names(arg)
        elif _is_call(node, "sum") and node.args and isinstance(node.args[0], ast.BinOp) \
                and isinstance(node.args[0].op, ast.Mult):  # a dot written as a reduced product (decode)
            self.has_dot = True
            self.dot_operands |= _value_names(node.args[0])
        if _is_call(node, "maximum"):
            self.maximum = True
        if (_is_call(node, "exp") or _is_call(node, "exp2")) and node.args \
                and any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) for n in ast.walk(node.args[0])):
            self.exp_of_diff = True
        self.generic_visit(node)


def _closure(deps: dict[str, set[str]], start: set[str]) -> set[str]:
    """Every name that `start` flows into (forward through assignments)."""
    reached, changed = set(start), True
    while changed:
        changed = False
        for name, read in deps.items():
            if name not in reached and read & reached:
                reached.add(name)
                changed = True
    return reached




def _function_regions(fn: ast.FunctionDef) -> list[Region]:
    flow = _Flow()
    for st in fn.body:
        flow.visit(st)
    if not flow.has_dot:
        if flow.exp_of_diff and flow.maximum and len(flow.loads) >= 2:
            end = fn.end_lineno or fn.lineno
            return [Region("split_kv_combine", f"{fn.name}: merge of partial attention states (max of their LSEs, exp-weighted outputs)",
                           "combine o, lse = (o_parts, lse_parts)", fn.lineno, end, (("split_kv", True),))]
        return []
    attention = [ld for ld in flow.loads if _closure(flow.value_deps, {ld.target}) & flow.dot_operands]
    pointers = set().union(*(ld.pointer for ld in attention)) if attention else set()
    out: list[Region] = []
    for ld in flow.loads:
        if ld in attention:
            continue
        if _closure(flow.deps, {ld.target}) & pointers:
            under_loop = bool(_closure(flow.deps, set(ld.loop_vars)) & ld.pointer)
            if under_loop:
                out.append(Region("paged_kv", f"{fn.name}: KV rows through a table read per KV block ({ld.target})",
                                  "load kt = k[load(table, b, n // PAGE), n % PAGE :+ BLOCK_N, hk, :]",
                                  ld.line, ld.end, (("paged_kv", True),)))
            else:
                out.append(Region("varlen", f"{fn.name}: a per-sequence value read once addresses the packed q/k/v rows ({ld.target})",
                                  "load qt = q[q0 + m_start :+ BLOCK_M until q0 + q_len, h, :]",
                                  ld.line, ld.end, (("varlen", True),)))
        elif not ld.loop_vars and _closure(flow.deps, {ld.target}) & flow.bounds:
            out.append(Region("varlen", f"{fn.name}: per-sequence length bounds the KV loop ({ld.target})",
                              "for n in range(0, kv_len, BLOCK_N) forward:", ld.line, ld.end, (("varlen", True),)))
    return out


def serving_regions(fn: ast.FunctionDef) -> list[Region]:
    """The serving regions of one jit function, one per source span."""
    seen: set[tuple[str, int]] = set()
    out = []
    for r in _function_regions(fn):
        if (r.kind, r.start) not in seen:
            seen.add((r.kind, r.start))
            out.append(r)
    return out
