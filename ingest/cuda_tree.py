"""Tree-sitter (CUDA grammar) view of a C++/CUDA file as a flat list of candidate regions.

A `Region` is a structural unit a lifter rule can match: a function or struct definition, the
then/else branch of an if-statement, or one statement/declaration. Parse errors (ERROR nodes)
are tolerated: regions inside them are still reported, and `error_count` says how many there were.
Line numbers are 1-based and inclusive.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Iterator

import tree_sitter_cuda
from tree_sitter import Language, Node, Parser

__all__ = ["RegionKind", "Region", "CudaFile", "parse_cuda", "node_name", "collapse"]


class RegionKind(str, Enum):
    FUNCTION = "function"
    STRUCT = "struct"
    IF = "if"  # the condition and its then-branch
    ELSE = "else"  # the else-branch; head is the negated condition
    STMT = "stmt"  # a declaration, field, expression or return statement


@dataclass(frozen=True)
class Region:
    kind: RegionKind
    head: str  # function/struct name, the condition, or the collapsed statement text
    scope: str  # enclosing struct/function names joined by '::'
    line_start: int
    line_end: int
    node: Node


@dataclass(frozen=True)
class CudaFile:
    text: str
    lines: tuple[str, ...]
    root: Node
    error_count: int

    def excerpt(self, line_start: int, line_end: int) -> str:
        return "\n".join(self.lines[line_start - 1 : line_end])

    def node_text(self, node: Node) -> str:
        return node.text.decode("utf-8", "replace") if node.text is not None else ""

    def regions(self) -> Iterator[Region]:
        yield from _regions(self, self.root, ())


_STMT_TYPES = {"declaration", "field_declaration", "expression_statement", "return_statement", "alias_declaration"}
_NAME_TYPES = {"identifier", "field_identifier", "type_identifier", "destructor_name", "operator_name"}


@lru_cache(maxsize=1)
def _parser() -> Parser:
    return Parser(Language(tree_sitter_cuda.language()))


def parse_cuda(text: str) -> CudaFile:
    tree = _parser().parse(text.encode("utf-8"))
    errors = sum(1 for _ in _iter_errors(tree.root_node))
    return CudaFile(text, tuple(text.split("\n")), tree.root_node, errors)


def _iter_errors(node: Node) -> Iterator[Node]:
    if node.type == "ERROR" or node.is_missing:
        yield node
    for child in node.children:
        yield from _iter_errors(child)


def collapse(text: str) -> str:
    """Whitespace-collapsed text with // and /* */ comments removed."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def node_name(node: Node) -> str:
    """The declared name of a function definition or struct/class specifier ('' if none)."""
    target = node.child_by_field_name("declarator") if node.type == "function_definition" else node.child_by_field_name("name")
    while target is not None:
        if target.type in _NAME_TYPES:
            return target.text.decode() if target.text else ""
        if target.type in ("qualified_identifier", "template_function", "template_type"):
            inner = target.child_by_field_name("name")
            target = inner if inner is not None else (target.named_children[-1] if target.named_children else None)
            continue
        inner = target.child_by_field_name("declarator")
        target = inner if inner is not None else next((c for c in target.named_children if c.type in _NAME_TYPES), None)
    return ""


def _start(node: Node) -> int:
    # A template<...> prefix belongs to the definition it introduces.
    parent = node.parent
    if parent is not None and parent.type == "template_declaration":
        node = parent
    return node.start_point.row + 1


def _regions(f: CudaFile, node: Node, scope: tuple[str, ...]) -> Iterator[Region]:
    for child in node.children:
        t = child.type
        inner_scope = scope
        if t == "function_definition":
            name = node_name(child)
            yield Region(RegionKind.FUNCTION, name, "::".join(scope), _start(child), child.end_point.row + 1, child)
            inner_scope = scope + (name,)
        elif t in ("struct_specifier", "class_specifier") and child.child_by_field_name("body") is not None:
            name = node_name(child)
            yield Region(RegionKind.STRUCT, name, "::".join(scope), _start(child), child.end_point.row + 1, child)
            inner_scope = scope + (name,)
        elif t == "if_statement":
            yield from _if_regions(f, child, scope)
        elif t in _STMT_TYPES:
            yield Region(RegionKind.STMT, collapse(f.node_text(child)), "::".join(scope),
                         child.start_point.row + 1, child.end_point.row + 1, child)
        yield from _regions(f, child, inner_scope)


def _if_regions(f: CudaFile, node: Node, scope: tuple[str, ...]) -> Iterator[Region]:
    cond_node = node.child_by_field_name("condition")
    then = node.child_by_field_name("consequence")
    if cond_node is None or then is None:
        return
    cond = collapse(f.node_text(cond_node))
    if cond.startswith("(") and cond.endswith(")"):
        cond = cond[1:-1].strip()
    s = "::".join(scope)
    yield Region(RegionKind.IF, cond, s, node.start_point.row + 1, then.end_point.row + 1, node)
    alt = node.child_by_field_name("alternative")
    if alt is not None:
        yield Region(RegionKind.ELSE, f"!({cond})", s, alt.start_point.row + 1, alt.end_point.row + 1, alt)
