"""Static scan of the candidate's source (AST), before anything runs.

Findings, most serious first:
- hack_suspected "fallback": a `try` whose `except` handler calls the reference or a
  torch compute op (a kernel that silently falls back when it fails).
- hack_suspected "calls_reference": the name `Model`, an import of the spec module, or
  dynamic code loading (exec/eval/compile/__import__/importlib/runpy) that could hide it.
- forbidden_call: torch compute calls an attention kernel must not make (SDPA, softmax,
  matmul family, `@`), unless torch-baseline mode. Calls rooted at `tl`/`triton` (e.g.
  `tl.dot`) are kernel code and allowed.
- forbidden_call "autograd" (backward runs, not in torch-baseline mode): calls that make torch
  differentiate instead of the candidate's kernels: `torch.autograd.grad` / `.backward(...)` /
  `torch.autograd.functional.*` / `torch.func` transforms anywhere, and `enable_grad` /
  `set_grad_enabled` inside a function named `backward` (an autograd.Function's backward).
  Hidden spellings are left to the dynamic guard (verify.guard, phase backward).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from verify.result import Verdict

__all__ = ["StaticFinding", "scan_candidate", "FORBIDDEN_CALLS"]

FORBIDDEN_CALLS = frozenset({
    "scaled_dot_product_attention", "softmax", "log_softmax", "matmul", "bmm", "mm", "baddbmm", "addmm", "addbmm",
    "einsum", "tensordot", "linear", "mv", "dot", "flash_attn_func", "flex_attention", "multi_head_attention_forward",
})
KERNEL_ROOTS = frozenset({"tl", "triton", "cute", "cutlass"})
LOADERS = frozenset({"exec", "eval", "compile", "__import__"})
LOADER_MODULES = frozenset({"importlib", "runpy"})
AUTOGRAD_MODULES = ("torch.autograd", "torch.func", "functorch", "torch._functorch")
AUTOGRAD_CALLS = frozenset({"grad", "backward", "vjp", "jvp", "grad_and_value", "jacrev", "jacfwd", "hessian",
                            "jacobian", "vhp", "hvp"})
GRAD_MODE_CALLS = frozenset({"enable_grad", "set_grad_enabled"})


@dataclass(frozen=True)
class StaticFinding:
    verdict: Verdict
    op: str
    message: str
    line: int
    phase: str = "forward"  # "backward" for the autograd findings


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else None


def _forbidden_call(node: ast.AST, kernel_aliases: set[str]) -> str | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return "@ (matmul operator)"
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name in FORBIDDEN_CALLS and _root(func) not in kernel_aliases:
        return name
    return None


def _reference_use(node: ast.AST, spec_module: str) -> str | None:
    if isinstance(node, ast.Name) and node.id == "Model":
        return "Model"
    if isinstance(node, ast.Import) and any(a.name.split(".")[0] in {spec_module, *LOADER_MODULES} for a in node.names):
        return "import " + ", ".join(a.name for a in node.names)
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in {spec_module, *LOADER_MODULES}:
        return f"from {node.module} import ..."
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in LOADERS:
        return node.func.id
    return None


def _lineno(node: ast.AST) -> int:
    """The line of a node a check flagged: always an expression or a statement, which carry one."""
    assert isinstance(node, (ast.expr, ast.stmt)), node
    return node.lineno


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _autograd_names(tree: ast.AST) -> dict[str, str]:
    """Local names bound to autograd modules or functions, with what they stand for
    (`from torch.autograd import grad as g` -> {"g": "grad"}; `import torch.func as tf` -> {"tf": "torch.func"})."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(AUTOGRAD_MODULES):
            names.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names.update({a.asname or a.name: f"torch.{a.name}" for a in node.names if a.name in {"autograd", "func"}})
        elif isinstance(node, ast.Import):
            names.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith(AUTOGRAD_MODULES)})
    return names


def _autograd_call(node: ast.AST, autograd_names: dict[str, str], kernel_aliases: set[str]) -> str | None:
    """The call's spelling when it asks torch autograd for gradients (see the module docstring)."""
    if not isinstance(node, ast.Call) or _root(node.func) in kernel_aliases:
        return None
    path = _dotted(node.func)
    head, _, rest = path.partition(".")
    if head in autograd_names:  # resolve an imported alias to what it names
        path = autograd_names[head] + (f".{rest}" if rest else "")
    last = path.rsplit(".", 1)[-1]
    if isinstance(node.func, ast.Attribute) and last == "backward":
        return path
    via_module = head in autograd_names or any(f".{m.split('.')[-1]}." in f".{path}" for m in AUTOGRAD_MODULES)
    if (last in AUTOGRAD_CALLS and via_module) or "autograd.functional" in path:
        return path
    return None


def _grad_mode_in_backward(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == "backward":
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and _dotted(node.func).rsplit(".", 1)[-1] in GRAD_MODE_CALLS:
                    found.append((_dotted(node.func), node.lineno))
    return found


def _autograd_findings(tree: ast.AST, kernel_aliases: set[str]) -> list[StaticFinding]:
    names = _autograd_names(tree)
    found = [StaticFinding(Verdict.forbidden_call, "autograd", f"candidate calls {what}: gradients must come from its "
                           "own backward kernels, not torch autograd", _lineno(node), "backward")
             for node in ast.walk(tree) if (what := _autograd_call(node, names, kernel_aliases))]
    found += [StaticFinding(Verdict.forbidden_call, "autograd", f"backward calls {what}: a backward that records a graph "
                            "has torch differentiate a re-computation", line, "backward")
              for what, line in _grad_mode_in_backward(tree)]
    return found


def _kernel_aliases(tree: ast.AST) -> set[str]:
    aliases = set(KERNEL_ROOTS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] in KERNEL_ROOTS}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in KERNEL_ROOTS:
            aliases |= {a.asname or a.name for a in node.names}
    return aliases


def scan_candidate(path: Path, spec_path: Path, torch_baseline: bool, backward: bool = False) -> list[StaticFinding]:
    """Findings in order of seriousness (empty: nothing suspicious). SyntaxError propagates.

    backward: the run checks gradients too, so autograd calls are findings (not in torch-baseline mode)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = _kernel_aliases(tree)
    spec_module = spec_path.stem
    found: list[StaticFinding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler):
            for sub in ast.walk(node):
                what = _reference_use(sub, spec_module) or _forbidden_call(sub, aliases)
                if what:
                    found.append(StaticFinding(Verdict.hack_suspected, "fallback",
                                               f"except handler falls back to {what}", _lineno(sub)))
                    break
    for node in ast.walk(tree):
        what = _reference_use(node, spec_module)
        if what:
            found.append(StaticFinding(Verdict.hack_suspected, "calls_reference",
                                       f"candidate uses {what} (the reference or dynamic code loading)", _lineno(node)))
    if not torch_baseline:
        for node in ast.walk(tree):
            what = _forbidden_call(node, aliases)
            if what:
                found.append(StaticFinding(Verdict.forbidden_call, what,
                                           f"candidate calls {what}; use --torch-baseline for plain torch re-implementations",
                                           _lineno(node)))
        if backward:
            found += _autograd_findings(tree, aliases)
    return found
