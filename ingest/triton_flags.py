"""Which constexpr flags a Triton kernel is lifted for, and one skip line per reason over its flag combinations.

`flag_values(fn, mod)`: the constexprs fixed by policy (`ingest.triton_source.flag_policy`), the enumerated feature
flags (`ENUMERATED_FLAGS`: causal, ALiBi) and up to `MAX_FLAGS_BY_USE` flags known only by use (the whole test of
an `if`); each combination of the enumerated ones is one lift. `merge_skips` folds the combinations that failed
for one reason into one line. Both the forward lifter (ingest.lift_triton) and the backward one
(ingest.lift_triton_bwd) use them.
"""

from __future__ import annotations

import ast

from ingest.triton_dims import infer_dims
from ingest.triton_source import ENUMERATED_FLAGS, JitFn, TritonModule, Unknown, flag_policy

__all__ = ["flag_values", "merge_skips", "MAX_FLAGS_BY_USE"]


def flag_values(fn: JitFn, mod: TritonModule) -> tuple[dict[str, object], list[str]]:
    """Fixed constexpr values by policy, and the enumerated feature flags present in the kernel."""
    params = {a.arg for a in fn.node.args.args}
    fixed: dict[str, object] = {k: v for k, v in mod.module_values.items() if k not in params}  # globals read by value
    enumerated: list[str] = []
    names = list(fn.constexprs) + list(mod.module_consts)
    for n in names:
        if any(p.search(n) for p in ENUMERATED_FLAGS.values()):
            enumerated.append(n)
            continue
        try:
            fixed[n] = flag_policy(n)
        except Unknown:
            pass
    for node in ast.walk(fn.node):  # local constexpr flags (`RCP_LN2: tl.constexpr = ...` are folded by specialize)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            try:
                fixed[node.target.id] = flag_policy(node.target.id)
            except Unknown:
                pass
    fixed |= _specialised_paths(fn, set(fixed) | set(enumerated))
    by_use = [n for n in fn.constexprs if n not in fixed and n not in enumerated and _switches(fn, mod, n)]
    return fixed, enumerated + by_use[:MAX_FLAGS_BY_USE]


MAX_FLAGS_BY_USE = 3  # at most 2**3 lifts of one kernel for flags known only by use


def _switches(fn: JitFn, mod: TritonModule, name: str) -> bool:
    """`name` is a feature flag by use: the whole test of an `if` (`if X:`, `if not X:`, `if X and Y:`) in the
    kernel or a jit helper it calls. The names the policy knows are hints; this finds `causal`, `MASKED`, ..."""
    def is_flag(test: ast.expr) -> bool:
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return is_flag(test.operand)
        if isinstance(test, ast.BoolOp):
            return any(is_flag(v) for v in test.values)
        return isinstance(test, ast.Name) and test.id == name

    called = {c.func.id for c in ast.walk(fn.node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    bodies = [fn.node] + [g.node for g in (*mod.jit.values(), *mod.imported_jit.values()) if g.name in called]
    return any(isinstance(n, (ast.If, ast.IfExp)) and is_flag(n.test) for body in bodies for n in ast.walk(body))


def _specialised_paths(fn: JitFn, known: set[str]) -> dict[str, object]:
    """A constexpr (not a size) that an `if X == literal:` tests selects the path written for that value
    (SGLang's `if PAGE_SIZE == 1:` token-pool addressing); it is fixed to the literal."""
    dims = infer_dims(fn.node, fn.node.body, {})
    out: dict[str, object] = {}
    for n in ast.walk(fn.node):
        t = n.test if isinstance(n, ast.If) else None
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq) \
                and isinstance(t.left, ast.Name) and isinstance(t.comparators[0], ast.Constant) \
                and t.left.id in fn.constexprs and t.left.id not in known | set(dims):
            out.setdefault(t.left.id, t.comparators[0].value)
    return out


def merge_skips(kernel: str, skips: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One line per reason: flag combinations that failed alike are listed together."""
    by_reason: dict[str, list[str]] = {}
    for what, why in skips:
        by_reason.setdefault(why, []).append(what[len(kernel) + 1:-1] if what.startswith(kernel + "[") else what)
    return [(f"{kernel}[{' | '.join(labels)}]" if len(labels) < 3 else f"{kernel}[{len(labels)} flag combinations]", why)
            for why, labels in by_reason.items()]
