"""Read a Triton source file: jit kernels, constexpr flags, autotune configs, launch constants.

`specialize` folds `if` statements on constexpr flags and inlines calls to other `@triton.jit`
functions (same file, or a sibling module named in `from .x import f`), so that the lifter
sees one flat statement list per kernel and flag combination.

Invariants: every AST node keeps its original line numbers; nodes that come from another
file carry `_kb_file` (the file name), so spans always point at real lines. Nothing here
imports or runs the source.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

__all__ = ["TritonModule", "JitFn", "ConfigEntry", "LaunchSite", "parse_module", "specialize", "const_eval",
           "Unknown", "flag_policy", "node_file"]

log = logging.getLogger(__name__)


class Unknown(Exception):
    """A value that is not a compile-time constant."""


class _NotNone:
    """A runtime value known not to be None (so `x is not None` folds)."""

    def __repr__(self) -> str:
        return "<not None>"


NOT_NONE = _NotNone()


@dataclass(frozen=True)
class JitFn:
    name: str
    node: ast.FunctionDef
    file: str
    constexprs: tuple[str, ...]


@dataclass(frozen=True)
class ConfigEntry:
    """One `triton.Config(...)`: kwargs dict + num_warps/num_stages, the function it is in, its line."""

    params: dict
    function: str
    line: int


@dataclass(frozen=True)
class LaunchSite:
    kernel: str
    line: int
    constants: dict  # keyword -> literal value (or launcher-local literal)
    keyword_exprs: dict  # keyword -> source text
    args: tuple[str | None, ...] = ()  # positional arguments that are plain names (None otherwise)
    factors: dict = field(default_factory=dict)  # launcher-local name -> constant it was multiplied by (`x *= RCP_LN2`)


@dataclass
class TritonModule:
    path: Path
    file: str
    tree: ast.Module
    lines: list[str]
    jit: dict[str, JitFn] = field(default_factory=dict)
    configs: list[ConfigEntry] = field(default_factory=list)
    launches: list[LaunchSite] = field(default_factory=list)
    module_consts: dict[str, object] = field(default_factory=dict)
    imported_jit: dict[str, JitFn] = field(default_factory=dict)
    module_values: dict[str, object] = field(default_factory=dict)  # numeric module constants (LOG2E = 1.44...)


def node_file(node: ast.AST, default: str) -> str:
    return getattr(node, "_kb_file", default)


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
        if isinstance(target, ast.Name) and target.id == "jit":
            return True
    return False


def _constexprs(fn: ast.FunctionDef) -> tuple[str, ...]:
    return tuple(a.arg for a in fn.args.args if a.annotation is not None and "constexpr" in ast.unparse(a.annotation))


def _literal(node: ast.AST) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        raise Unknown(ast.unparse(node)) from None


def _collect_jit(tree: ast.Module, file: str) -> dict[str, JitFn]:
    out: dict[str, JitFn] = {}
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and _is_jit(n):
            if file:
                for sub in ast.walk(n):
                    setattr(sub, "_kb_file", file)
            out[n.name] = JitFn(n.name, n, file, _constexprs(n))
    return out


def parse_module(path: Path, file: str) -> TritonModule:
    """Parse `path` (raises SyntaxError on a malformed file; the caller reports it)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    tree = ast.parse(text, filename=str(path))
    mod = TritonModule(path, file, tree, text.splitlines())
    mod.jit = _collect_jit(tree, "")
    _collect_configs(mod)
    for n in tree.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and "constexpr" in ast.unparse(n.annotation):
            mod.module_consts[n.target.id] = None  # resolved by flag policy
        _module_value(mod, n)
        if isinstance(n, ast.ImportFrom) and n.module and (source := _imported_file(path, n)) is not None:
            _import_from(mod, n, source, file)
    _collect_launches(mod)  # after module constants: launchers scale arguments by them
    return mod


def _imported_file(path: Path, n: ast.ImportFrom) -> Path | None:
    """The file a `from X import ...` reads, if it is in the same tree: relative to the importing file's
    folder (`from .x`), or, for an absolute `from pkg.sub.mod`, below the first ancestor folder holding it."""
    rel = Path(*n.module.split(".")).with_suffix(".py")  # type: ignore[union-attr]
    if n.level:
        base = path.parent
        for _ in range(n.level - 1):
            base = base.parent
        return base / rel if (base / rel).is_file() else None
    return next((d / rel for d in path.parents if (d / rel).is_file()), None)


def _import_from(mod: TritonModule, n: ast.ImportFrom, source: Path, file: str) -> None:
    """Jit helpers and numeric constants imported from another file of the same release."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:
        return
    root = mod.path.parents[len(Path(file).parts) - 1] if file else source.parent
    try:
        rel = source.relative_to(root).as_posix()  # provenance of an imported helper, as the source root names it
    except ValueError:
        rel = source.name
    jit = _collect_jit(tree, rel)
    values = TritonModule(source, rel, tree, [])
    for st in tree.body:
        _module_value(values, st)
    for alias in n.names:
        name = alias.asname or alias.name
        if alias.name in jit:
            mod.imported_jit[name] = jit[alias.name]
        elif alias.name in values.module_values:
            mod.module_values[name] = values.module_values[alias.name]


def _module_value(mod: TritonModule, n: ast.stmt) -> None:
    """`X = 1.44`, `X: tl.constexpr = 1.44` or `X = tl.constexpr(1.44)` at module level: a number kernels may read."""
    target = n.targets[0] if isinstance(n, ast.Assign) and len(n.targets) == 1 else getattr(n, "target", None)
    value = getattr(n, "value", None)
    if not isinstance(target, ast.Name) or value is None:
        return
    if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("constexpr") and value.args:
        value = value.args[0]
    try:
        v = _literal(value)
    except Unknown:
        return
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        mod.module_values[target.id] = v


def _enclosing_functions(tree: ast.Module) -> dict[int, str]:
    owner: dict[int, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for sub in ast.walk(fn):
                owner.setdefault(id(sub), fn.name)
    return owner


def _collect_configs(mod: TritonModule) -> None:
    owner = _enclosing_functions(mod.tree)
    for n in ast.walk(mod.tree):
        if isinstance(n, ast.Call) and ast.unparse(n.func) in ("triton.Config", "Config") and n.args:
            try:
                # the kwargs of a Config are a dict literal; dict() raises on anything else
                params = dict(cast("dict[str | None, object]", _literal(n.args[0])))
            except Unknown:
                continue
            for kw in n.keywords:  # num_warps=, num_stages=; a callable (`pre_hook=init_to_zero("DQ")`) is left out
                try:
                    params[kw.arg] = _literal(kw.value)
                except Unknown:
                    pass
            mod.configs.append(ConfigEntry(params, owner.get(id(n), "<module>"), n.lineno))


def _collect_launches(mod: TritonModule) -> None:
    for fn in ast.walk(mod.tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name in mod.jit:
            continue
        local: dict[str, object] = {}
        _cuda_path_locals(fn.body, local, set())
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name) \
                    and n.func.value.id in mod.jit:
                consts: dict[str, object] = {}
                exprs: dict[str, str] = {}
                for kw in n.keywords:
                    if kw.arg is None:
                        continue
                    exprs[kw.arg] = ast.unparse(kw.value)
                    try:
                        consts[kw.arg] = _literal(kw.value)
                    except Unknown:
                        if isinstance(kw.value, ast.Name) and kw.value.id in local:
                            consts[kw.arg] = local[kw.value.id]
                args = tuple(a.id if isinstance(a, ast.Name) else None for a in n.args)
                mod.launches.append(LaunchSite(n.func.value.id, n.lineno, consts, exprs, args, _factors(fn, mod)))


# A launcher's check for another vendor's GPU (`is_hip_`, `is_hip()`, `current_platform.is_rocm()`, `is_xpu`).
# Whole words between underscores or dots, so `has_input` is no NPU check.
_OTHER_VENDOR = re.compile(r"(?<![a-z])(?:hip|rocm|amd|gfx\d*|cdna\d*|rdna\d*|xpu|npu)(?![a-z])", re.IGNORECASE)


def _on_cuda(test: ast.expr) -> bool | None:
    """A launcher's branch condition on an NVIDIA GPU: another vendor's check is false, `not` / `and` / `or` of such
    checks as Python evaluates them, anything else (a shape, a flag) unknown (None)."""
    if isinstance(test, ast.Name | ast.Attribute | ast.Call) and _OTHER_VENDOR.search(ast.unparse(test)):
        return False
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _on_cuda(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        vals = [_on_cuda(v) for v in test.values]
        decided, rest = (False, True) if isinstance(test.op, ast.And) else (True, False)
        return decided if decided in vals else rest if all(v is rest for v in vals) else None
    return None


def _cuda_value(node: ast.expr) -> object:
    """A literal, or the branch an NVIDIA GPU takes of `a if <vendor check> else b` (`64 if not is_hip_ else 8`)."""
    if isinstance(node, ast.IfExp) and (taken := _on_cuda(node.test)) is not None:
        return _cuda_value(node.body if taken else node.orelse)
    return _literal(node)


def _cuda_path_locals(body: list[ast.stmt], local: dict[str, object], general: set[str], special: bool = False) -> None:
    """The literal values a launcher gives its names where it launches on an NVIDIA GPU, the last assignment winning,
    except that a branch only another vendor's GPU takes is left out (vLLM's `if is_hip_: BLOCK = 16` overrode the
    `BLOCK = 32` CUDA runs) and a branch on anything else (a shape, a flag: a special case) does not override a name
    the unconditional path set (`general`, filled as that path is walked)."""
    for st in body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            name = st.targets[0].id
            if not (special and name in general):
                with contextlib.suppress(Unknown):
                    local[name] = _cuda_value(st.value)
                    if not special:
                        general.add(name)
        elif isinstance(st, ast.If):
            taken = _on_cuda(st.test)
            if taken is None:
                for branch in (st.body, st.orelse):
                    _cuda_path_locals(branch, local, general, True)
            else:
                _cuda_path_locals(st.body if taken else st.orelse, local, general, special)
        elif isinstance(st, ast.For | ast.While | ast.With | ast.Try):
            _cuda_path_locals(st.body, local, general, special)


def _factors(fn: ast.FunctionDef, mod: TritonModule) -> dict[str, float]:
    """Launcher-local names multiplied in place by a constant: `x *= C` or `x = x * C` (C a literal or module constant)."""
    out: dict[str, float] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Mult) and isinstance(n.target, ast.Name):
            name, factor = n.target.id, n.value
        elif isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) \
                and isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Mult) \
                and ast.unparse(n.targets[0]) in (ast.unparse(n.value.left), ast.unparse(n.value.right)):
            name = n.targets[0].id
            factor = n.value.right if ast.unparse(n.value.left) == name else n.value.left
        else:
            continue
        value = mod.module_values.get(factor.id) if isinstance(factor, ast.Name) else None
        if value is None:
            try:
                value = _literal(factor)
            except Unknown:
                continue
        if isinstance(value, (int, float)):
            out[name] = out.get(name, 1.0) * float(value)
    return out


# ---------------------------------------------------------------- flag policy

# Flags that select a feature the IR can execute: the lifter enumerates them.
ENUMERATED_FLAGS = {"causal": re.compile(r"CAUSAL"), "alibi": re.compile(r"ALIBI")}
# Everything else is fixed to the general path the IR can express; dropout, fp8, varlen, paged
# caches, bias pointers and debug dumps are switched off (recorded as snippets/skips instead).
_POLICY: tuple[tuple[re.Pattern, object], ...] = (
    (re.compile(r"DROPOUT|FP8|VARLEN|INFERENCE|RETURN_SCORES|NEW_KV|CACHE|USE_BIAS|DUMP"), False),
    (re.compile(r"^BIAS_TYPE$"), "none"),
    (re.compile(r"^EVEN_"), False),
    (re.compile(r"PRE_LOAD_V"), False),
    (re.compile(r"PADDED_HEAD|BOUNDS_CHECKS|MASK_SPLITK|^IS_GQA$"), True),
    (re.compile(r"USE_EXP2"), True),
    (re.compile(r"SINKS"), False),  # attention sinks (vLLM): an extra logit per head, not in the IR
    (re.compile(r"^SLIDING_WINDOW"), 0),  # vLLM's window sizes; 0 = no window
    (re.compile(r"^(logit_cap|xai_temperature_len)$"), 0),  # serving decode: tanh logit cap, length temperature off
    (re.compile(r"^SCORE_MOD$"), None),  # SGLang's jit score_mod hook: none
    (re.compile(r"^ROTATE_BATCH$"), False),  # SGLang's HIP batch rotation over XCDs (a launch order only)
    (re.compile(r"^(HAS_MLA|IS_MLA)$"), False),  # grouped decode: v is not k's transpose (no MLA latent cache)
    (re.compile(r"^BLOCK_DPE$"), 0),  # grouped decode: no MLA rope part (a second score dot)
    (re.compile(r"^(USE_PDL|IS_GFX1250|USE_FORCED)$"), False),  # SGLang: launch dependency, gfx1250 casts, forced splits
)


def flag_policy(name: str) -> object:
    """The fixed value of a non-enumerated constexpr flag; raises Unknown for non-flags."""
    for pat, value in _POLICY:
        if pat.search(name):
            return value
    raise Unknown(name)


# ---------------------------------------------------------------- constant folding


def const_eval(node: ast.AST, consts: dict[str, object]) -> object:
    """Fold `node` under `consts`; raises Unknown if it depends on a runtime value."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in consts:
            if consts[node.id] is NOT_NONE:
                raise Unknown(node.id)
            return consts[node.id]
        if node.id in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[node.id]
        raise Unknown(node.id)
    if isinstance(node, ast.UnaryOp):
        v = const_eval(node.operand, consts)
        if isinstance(node.op, ast.Not):
            return not v
        if isinstance(node.op, ast.USub):
            return -v  # type: ignore[operator]
        raise Unknown(ast.unparse(node))
    if isinstance(node, ast.BoolOp):
        vals = []
        for v in node.values:
            try:
                vals.append(const_eval(v, consts))
            except Unknown:
                vals.append(Unknown)
        known = [v for v in vals if v is not Unknown]
        if isinstance(node.op, ast.And):
            if any(not v for v in known):
                return False
            if len(known) == len(vals):
                return all(vals)
        else:
            if any(bool(v) for v in known):
                return True
            if len(known) == len(vals):
                return False
        raise Unknown(ast.unparse(node))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)):
        sides: list[object] = []
        for x in (node.left, node.comparators[0]):
            if isinstance(x, ast.Name) and consts.get(x.id, None) is NOT_NONE:
                sides.append(NOT_NONE)
            else:
                sides.append(const_eval(x, consts))
        if None in sides:
            same = sides[0] is sides[1]
            return same if isinstance(node.ops[0], ast.Is) else not same
        raise Unknown(ast.unparse(node))
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        a, b = const_eval(node.left, consts), const_eval(node.comparators[0], consts)
        op = node.ops[0]
        table = {ast.Eq: lambda: a == b, ast.NotEq: lambda: a != b, ast.Is: lambda: a is b,
                 ast.IsNot: lambda: a is not b, ast.Lt: lambda: a < b, ast.Gt: lambda: a > b,  # type: ignore[operator]
                 ast.LtE: lambda: a <= b, ast.GtE: lambda: a >= b}  # type: ignore[operator]
        if type(op) in table:
            return table[type(op)]()
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
        a, b = const_eval(node.left, consts), const_eval(node.right, consts)
        return (a and b) if isinstance(node.op, ast.BitAnd) else (a or b)
    if isinstance(node, ast.IfExp):
        return const_eval(node.body if const_eval(node.test, consts) else node.orelse, consts)
    if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".dtype.is_fp8") and not node.args:
        return False  # fp8 caches are off by the flag policy (vLLM's `if k.dtype.is_fp8():` dequantization)
    if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("constexpr") and node.args:
        return const_eval(node.args[0], consts)
    raise Unknown(ast.unparse(node))


# ---------------------------------------------------------------- specialization + inlining


def _bind(name: str, value: ast.expr, at: ast.AST) -> ast.Assign:
    a = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=value)
    return ast.copy_location(a, at)


def _maybe_none(value: ast.AST, consts: dict[str, object]) -> object:
    """The constant value, or NOT_NONE for a runtime value that cannot be None."""
    try:
        return const_eval(value, consts)
    except Unknown:
        pass
    if isinstance(value, ast.IfExp):
        try:
            return _maybe_none(value.body if const_eval(value.test, consts) else value.orelse, consts)
        except Unknown:
            return None if False else _Unset
    if isinstance(value, ast.Name):
        return consts.get(value.id, _Unset)
    return NOT_NONE


_Unset = object()


def _track(target: ast.AST, value: ast.AST, consts: dict[str, object]) -> None:
    if isinstance(target, ast.Name):
        try:
            consts[target.id] = flag_policy(target.id)  # a policy flag keeps its fixed value
            return
        except Unknown:
            pass
        v = _maybe_none(value, consts)
        if v is _Unset:
            consts.pop(target.id, None)
        else:
            consts[target.id] = v


def _inline(call: ast.Call, fn: JitFn, targets: list[ast.expr], consts: dict[str, object],
            mod: TritonModule, depth: int, calls: bool = False) -> list[ast.stmt]:
    """Bind parameters, specialize the body in a child constant scope, turn `return` into assigns."""
    raw = [a.arg for a in fn.node.args.args]
    fn_body = copy.deepcopy(fn.node.body)
    _INLINE_COUNT[0] += 1
    rename = _local_names(raw, fn_body, _INLINE_COUNT[0])
    params = [rename[p] for p in raw]
    defaults = dict(zip(params[len(params) - len(fn.node.args.defaults):], fn.node.args.defaults))
    args: dict[str, ast.expr] = dict(zip(params, call.args))
    args.update({rename[kw.arg]: kw.value for kw in call.keywords if kw.arg in rename})
    child = dict(consts)
    out: list[ast.stmt] = []
    for p in params:
        val = args.get(p, defaults.get(p))
        if val is None:
            continue
        out.append(_bind(p, val, call))
        v = _maybe_none(val, consts)
        if v is _Unset:
            child.pop(p, None)
        else:
            child[p] = v
    body = specialize(fn_body, child, mod, depth + 1, calls=calls)
    for st in body:
        if isinstance(st, ast.Return) and st.value is not None:
            vals = st.value.elts if isinstance(st.value, ast.Tuple) else [st.value]
            tgts = targets[0].elts if len(targets) == 1 and isinstance(targets[0], ast.Tuple) else targets
            for t, v in zip(tgts, vals):
                if isinstance(t, ast.Name) and not (isinstance(v, ast.Name) and v.id == t.id):
                    out.append(_bind(t.id, v, st))
        else:
            out.append(st)
    return out


_INLINE_COUNT = [0]


def _local_names(params: list[str], body: list[ast.stmt], k: int) -> dict[str, str]:
    """Rename the callee's params and locals (`x` -> `x_i<k>`) so inlining cannot clobber the caller.

    Flags (names the policy or the enumerated flags know) keep their names: their values are
    bound from the call's arguments in the child constant scope either way.
    """
    local = set(params)
    for st in body:
        for n in ast.walk(st):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                local.add(n.id)
    rename = {n: f"{n}_i{k}" for n in local}
    for st in body:
        for n in ast.walk(st):
            if isinstance(n, ast.Name) and n.id in rename:
                n.id = rename[n.id]
    return rename


def _callee(node: ast.AST, mod: TritonModule) -> JitFn | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return mod.jit.get(node.func.id) or mod.imported_jit.get(node.func.id)
    return None


def specialize(body: list[ast.stmt], consts: dict[str, object], mod: TritonModule, depth: int = 0, *,
               calls: bool = False) -> list[ast.stmt]:
    """Fold constexpr `if`s, inline jit calls, track constant assignments (in `consts`).

    With `calls`, a jit call that is a statement of its own (`_store_dk_dv(...)`) is inlined too."""
    if depth > 8:
        raise RecursionError("jit call nesting deeper than 8")
    out: list[ast.stmt] = []
    for st in body:
        if isinstance(st, ast.If):
            try:
                taken = const_eval(st.test, consts)
            except Unknown:
                st.body = specialize(st.body, dict(consts), mod, depth, calls=calls)
                st.orelse = specialize(st.orelse, dict(consts), mod, depth, calls=calls)
                for sub in st.body + st.orelse:  # runtime branch: assigned names are no longer constant
                    for n in ast.walk(sub):
                        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                            consts.pop(n.id, None)
                out.append(st)
                continue
            out.extend(specialize(st.body if taken else st.orelse, consts, mod, depth, calls=calls))
            continue
        if isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None:
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            fn = _callee(st.value, mod)
            if fn is not None:
                out.extend(_inline(st.value, fn, targets, consts, mod, depth, calls))  # type: ignore[arg-type]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            consts.pop(n.id, None)
                continue
            if len(targets) == 1:
                _track(targets[0], st.value, consts)
            out.append(st)
            continue
        if isinstance(st, ast.For):
            st.body = specialize(st.body, dict(consts), mod, depth, calls=calls)
            out.append(st)
            continue
        if calls and isinstance(st, ast.Expr) and (fn := _callee(st.value, mod)) is not None:
            out.extend(_inline(st.value, fn, [], consts, mod, depth, calls))  # type: ignore[arg-type]
            continue
        out.append(st)
    return out
