"""What a loop body written as its own `@triton.jit` function takes from the kernel and hands back to it.

kb.lower.triton_kernel emits the body of a loop split by block class once, as a helper each part of the loop calls
(`IS_FULL` set per part). Its interface is read off its text: a name read before the body assigns it is an argument
(a kernel local, parameter or constexpr); an argument the body assigns is loop-carried state, returned. Names the
generated module defines (its imports, the preambles' functions, Python's builtins) are neither.
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass
from functools import cache

from kb.lower.preambles import preamble_text

__all__ = ["Interface", "body_interface", "merge_branches", "module_names"]


@dataclass(frozen=True)
class Interface:
    params: tuple[str, ...]  # in order of first read
    returns: tuple[str, ...]  # the params the body assigns, in order of first assignment


@cache
def module_names() -> frozenset[str]:
    """What a generated module defines besides its kernels: its imports, the preambles' functions and globals, and
    Python's builtins."""
    names = set(dir(builtins))
    for module_file in ("triton_preamble.py", "triton_bwd_preamble.py"):
        for node in ast.parse(preamble_text(module_file)).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return frozenset(names)


class _Scan:
    """One pass over the statements in order, tracking which names are bound so far on the way."""

    def __init__(self) -> None:
        self.free: dict[str, None] = {}
        self.assigned: dict[str, None] = {}

    def read(self, node: ast.AST, bound: set[str]) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound \
                    and n.id not in module_names():
                self.free.setdefault(n.id)

    def bind(self, target: ast.AST, bound: set[str]) -> None:
        for n in ast.walk(target):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                bound.add(n.id)
                self.assigned.setdefault(n.id)
            elif isinstance(n, (ast.Subscript, ast.Attribute)):
                self.read(n, bound)

    def block(self, body: list[ast.stmt], bound: set[str]) -> None:
        for st in body:
            if isinstance(st, ast.If):
                self.read(st.test, bound)
                then, orelse = set(bound), set(bound)
                self.block(st.body, then)
                self.block(st.orelse, orelse)
                bound |= then | orelse  # a constexpr branch: the names of the branch compiled
            elif isinstance(st, ast.For):
                self.read(st.iter, bound)
                self.bind(st.target, bound)
                self.block(st.body, bound)
            elif isinstance(st, ast.Assign):
                self.read(st.value, bound)
                for t in st.targets:
                    self.bind(t, bound)
            elif isinstance(st, (ast.AugAssign, ast.AnnAssign)):
                if st.value is not None:
                    self.read(st.value, bound)
                if isinstance(st, ast.AugAssign):
                    self.read(ast.Name(st.target.id, ast.Load()) if isinstance(st.target, ast.Name) else st.target, bound)
                self.bind(st.target, bound)
            else:
                self.read(st, bound)


def body_interface(lines: list[str]) -> Interface:
    """The arguments and returned state of a function whose body is `lines` (indented one level, comments allowed)."""
    tree = ast.parse("def _body():\n" + "\n".join(lines))
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    scan = _Scan()
    scan.block(fn.body, set())
    return Interface(tuple(scan.free), tuple(n for n in scan.assigned if n in scan.free))


def merge_branches(lines: list[str], indent: str = "    ") -> list[str]:
    """`lines` (a helper's body) with adjacent `if IS_FULL:` / `else:` statements at `indent` merged into one, `pass`
    dropped where a branch has code, and a branch with none left out (its comments kept before the `if`)."""
    forks: list[list[str] | tuple[list[str], list[str]]] = []

    def branch(i: int) -> tuple[list[str], int]:
        j = i
        while j < len(lines) and lines[j].startswith(indent + " "):
            j += 1
        return lines[i:j], j

    i = 0
    while i < len(lines):
        if lines[i] != indent + "if IS_FULL:":
            forks.append([lines[i]])
            i += 1
            continue
        full, i = branch(i + 1)
        partial: list[str] = []
        if i < len(lines) and lines[i] == indent + "else:":
            partial, i = branch(i + 1)
        if forks and isinstance(forks[-1], tuple):
            forks[-1][0].extend(full)
            forks[-1][1].extend(partial)
        else:
            forks.append((full, partial))
    inner = indent + "    "
    out: list[str] = []
    for item in forks:
        if isinstance(item, list):
            out += item
            continue
        full, partial = ([x for x in side if x != inner + "pass"] for side in item)
        code = [any(not x.lstrip().startswith("#") for x in side) for side in (full, partial)]
        if code[0] and code[1]:
            out += [indent + "if IS_FULL:", *full, indent + "else:", *partial]
        else:
            kept, dropped, head = (full, partial, "if IS_FULL:") if code[0] else (partial, full, "if not IS_FULL:")
            out += [x[4:] for x in dropped]
            if any(code):
                out += [indent + head, *kept]
    return out
