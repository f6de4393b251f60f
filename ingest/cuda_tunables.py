"""Tunables (tile shapes per head dim) from launch code: FA2's launch template and CUTLASS FMHA runners.

FA2 (`flash_fwd_launch_template.h`): every `Flash_fwd_kernel_traits<Headdim, kBlockM, kBlockN,
kNWarps, Is_Q_in_regs, Share_Q_K_smem, T>` inside `run_mha_fwd_hdimNN` / `run_mha_fwd_splitkv_dispatch`
becomes one tunable per dtype, with the chain of enclosing if-conditions (negated in else
branches) as its condition. Template arguments are evaluated with the function's
`constexpr static int` constants; the split-KV dispatch is templated on Headdim and is evaluated
for every head dim the file has a `run_mha_fwd_hdimNN` for.

CUTLASS (88/77 `*_fmha.cu`): `run(Shape<_M, _N, HeadDim>{}, Kernel..{}, "label")` calls inside
`run_fwd_NN`/`run_bwd_NN`-style functions, HeadDim from `using HeadDim = _D;`.
"""

from __future__ import annotations

import re
from typing import Iterator

from tree_sitter import Node

from ingest.cuda_tree import CudaFile, collapse, node_name

__all__ = ["RawTunable", "fa2_launch_tunables", "fa2_bwd_launch_tunables", "cutlass_runner_tunables", "SMEM_PER_ARCH"]

# (arch, head_dim, dtype, params, condition, line_start, line_end, family_suffix)
RawTunable = tuple[str, int, str, dict, str, int, int, str]

_TRAITS_PARAMS = ("head_dim", "block_m", "block_n", "num_warps", "q_in_regs", "share_qk_smem")


def _walk(node: Node) -> Iterator[Node]:
    yield node
    for c in node.children:
        yield from _walk(c)


def _field(node: Node, name: str) -> Node:
    """A child the grammar requires; tree-sitter's error recovery can still leave it out (then ValueError)."""
    child = node.child_by_field_name(name)
    if child is None:
        raise ValueError(f"{node.type} without {name}")
    return child


def _eval(node: Node, env: dict[str, int | bool]) -> int | bool:
    """Evaluate a constant C++ integer/boolean expression (raises KeyError/ValueError otherwise)."""
    t = node.type
    text = node.text.decode() if node.text else ""
    if t == "number_literal":
        return int(text.rstrip("uUlL"), 0)
    if t in ("true", "false"):
        return t == "true"
    if t in ("identifier", "type_identifier"):
        return env[text]
    if t == "type_descriptor":
        return _eval(node.named_children[0], env)
    if t == "parenthesized_expression":
        return _eval(node.named_children[0], env)
    if t == "unary_expression":
        op = _field(node, "operator").type
        v = _eval(_field(node, "argument"), env)
        return (not v) if op == "!" else -v
    if t == "conditional_expression":
        cond = _eval(_field(node, "condition"), env)
        return _eval(_field(node, "consequence" if cond else "alternative"), env)
    if t == "binary_expression":
        a = _eval(_field(node, "left"), env)
        b = _eval(_field(node, "right"), env)
        op = _field(node, "operator").type
        ops = {"+": a + b, "-": a - b, "*": a * b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b,
               "==": a == b, "!=": a != b, "&&": bool(a and b), "||": bool(a or b)}
        if op == "/":
            return int(a / b)
        return ops[op]
    raise ValueError(f"cannot evaluate {t}: {text}")


def _conditions(node: Node, stop: Node, f: CudaFile) -> list[str]:
    conds: list[str] = []
    child, parent = node, node.parent
    while parent is not None and parent != stop:
        if parent.type == "if_statement":
            cond = collapse(f.node_text(_field(parent, "condition")))
            cond = cond.replace("constexpr", "").strip()
            cond = cond[1:-1].strip() if cond.startswith("(") and cond.endswith(")") else cond
            alt = parent.child_by_field_name("alternative")
            conds.append(f"!({cond})" if alt is not None and child == alt else cond)
        elif parent.type == "call_expression" and f.node_text(_field(parent, "function")).endswith("_SWITCH"):
            pass  # FOO_SWITCH(cond, Name, lambda) only binds Name; conditions on Name follow inside
        child, parent = parent, parent.parent
    return [re.sub(r"^!\(!(\w+)\)$", r"\1", c) for c in reversed(conds)]


def _arch(cond: str) -> str:
    if re.search(r"(?<![!\w])is_sm8x(?!\w)", cond) and "!(is_sm8x)" not in cond:
        return "sm86"
    return "sm80"


def fa2_launch_tunables(f: CudaFile) -> list[RawTunable]:
    fns = [n for n in _walk(f.root) if n.type == "function_definition"]
    hdims = sorted(int(m.group(1)) for fn in fns if (m := re.fullmatch(r"run_mha_fwd_hdim(\d+)", node_name(fn))))
    out: list[RawTunable] = []
    for fn in fns:
        name = node_name(fn)
        m = re.fullmatch(r"run_mha_fwd_hdim(\d+)", name)
        if m is None and name != "run_mha_fwd_splitkv_dispatch":
            continue
        envs = [_const_env(fn, f, {})] if m else [_const_env(fn, f, {"Headdim": d}) for d in hdims]
        for env in envs:
            for n in _walk(fn):
                if n.type != "template_type" or f.node_text(_field(n, "name")) != "Flash_fwd_kernel_traits":
                    continue
                args = _field(n, "arguments").named_children
                try:
                    values = [_eval(a, env) for a in args[:6]]
                except (KeyError, ValueError, AttributeError, IndexError):
                    continue
                params = dict(zip(_TRAITS_PARAMS, values))
                head_dim = int(params.pop("head_dim"))
                params = {k: (bool(v) if k in ("q_in_regs", "share_qk_smem") else int(v)) for k, v in params.items()}
                stmt = n
                while stmt.parent is not None and stmt.type != "expression_statement":
                    stmt = stmt.parent
                cond = " && ".join(_conditions(stmt, fn, f))
                suffix = "_splitkv" if m is None else ""
                if m is None:
                    params["split_kv"] = True
                for dtype in ("fp16", "bf16"):
                    out.append((_arch(cond), head_dim, dtype, dict(params), cond,
                                stmt.start_point.row + 1, stmt.end_point.row + 1, suffix))
    return out


_BWD_TRAITS_PARAMS = ("head_dim", "block_m", "block_n", "num_warps", "atom_layout_m_sdp", "atom_layout_n_dkv",
                      "atom_layout_m_dq", "v_in_regs", "no_double_buffer")
# Opt-in shared memory per block (bytes) that FA2's backward dispatch tests (`max_smem_per_block >= ...`).
SMEM_PER_ARCH = {"sm80": 163 * 1024, "sm86": 99 * 1024, "sm90": 227 * 1024}


def fa2_bwd_launch_tunables(f: CudaFile) -> list[RawTunable]:
    """`Flash_bwd_kernel_traits<Headdim, kBlockM, kBlockN, kNWarps, AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ,
    Is_V_in_regs, No_double_buffer, T>` in `run_mha_bwd_hdimNN`: for every arch (its shared memory per block) the
    traits the dispatch picks without dropout (the IR has none), one tunable per dtype, marked backward."""
    out: list[RawTunable] = []
    for fn in (n for n in _walk(f.root) if n.type == "function_definition"):
        m = re.fullmatch(r"run_mha_bwd_hdim(\d+)", node_name(fn))
        if m is None:
            continue
        for n in _walk(fn):
            if n.type != "template_type" or f.node_text(_field(n, "name")) != "Flash_bwd_kernel_traits":
                continue
            stmt = n
            while stmt.parent is not None and stmt.type != "expression_statement":
                stmt = stmt.parent
            for arch, smem in SMEM_PER_ARCH.items():
                env = {**_const_env(fn, f, {}), "max_smem_per_block": smem, "Is_dropout": False}
                try:
                    if not all(_eval_cond(c, env) == want for c, want in _branches(stmt, fn)):
                        continue
                    values = [_eval(a, env) for a in _field(n, "arguments").named_children[:9]]
                except (KeyError, ValueError, AttributeError, IndexError):
                    continue
                params: dict = dict(zip(_BWD_TRAITS_PARAMS, values))
                head_dim = int(params.pop("head_dim"))
                params = {k: (bool(v) if k in ("v_in_regs", "no_double_buffer") else int(v)) for k, v in params.items()}
                params["direction"] = "backward"
                cond = " && ".join(_conditions(stmt, fn, f))
                for dtype in ("fp16", "bf16"):
                    out.append((arch, head_dim, dtype, dict(params), cond, stmt.start_point.row + 1,
                                stmt.end_point.row + 1, "_bwd"))
    return out


def _branches(node: Node, stop: Node) -> list[tuple[Node, bool]]:
    """The if-conditions around `node` up to `stop`, each with the value it must have (False in an else branch)."""
    out = []
    child, parent = node, node.parent
    while parent is not None and parent != stop:
        if parent.type == "if_statement":
            alt = parent.child_by_field_name("alternative")
            out.append((_field(parent, "condition"), not (alt is not None and child == alt)))
        child, parent = parent, parent.parent
    return out


def _eval_cond(node: Node, env: dict[str, int | bool]) -> bool:
    if node.type == "condition_clause":
        node = node.named_children[-1]
    return bool(_eval(node, env))


def _const_env(fn: Node, f: CudaFile, seed: dict[str, int]) -> dict[str, int | bool]:
    env: dict[str, int | bool] = {"false": False, "true": True, **seed}
    for n in _walk(fn):
        if n.type == "declaration" and "constexpr" in f.node_text(n):
            for d in n.children_by_field_name("declarator"):
                if d.type == "init_declarator":
                    try:
                        env[f.node_text(_field(d, "declarator"))] = _eval(_field(d, "value"), env)
                    except (KeyError, ValueError, AttributeError):
                        pass
    return env


_SHAPE = re.compile(r"^Shape<\s*_(\d+)\s*,\s*_(\d+)\s*,\s*(\w+)\s*>")


def cutlass_runner_tunables(f: CudaFile) -> list[RawTunable]:
    out: list[RawTunable] = []
    for fn in (n for n in _walk(f.root) if n.type == "function_definition"):
        name = node_name(fn)
        direction = "bwd" if "bwd" in name else "fwd" if "fwd" in name else ""
        if not direction:
            continue
        fn_text = f.node_text(fn)
        hd = re.search(r"using\s+HeadDim\s*=\s*_(\d+)\s*;", fn_text)
        for call in (n for n in _walk(fn) if n.type == "call_expression"):
            if f.node_text(_field(call, "function")) != "run":
                continue
            args = _field(call, "arguments").named_children
            shape = _SHAPE.match(collapse(f.node_text(args[0]))) if args else None
            if shape is None:
                continue
            third = shape.group(3)
            head_dim = int(third[1:]) if third.startswith("_") and third[1:].isdigit() else (int(hd.group(1)) if hd else 0)
            if not head_dim:
                continue
            params: dict[str, object] = {"block_m": int(shape.group(1)), "block_n": int(shape.group(2))}
            if direction == "bwd":
                params["direction"] = "backward"
            for a in args[1:]:
                text = collapse(f.node_text(a))
                if a.type == "string_literal":
                    params["label"] = text.strip('"')
                elif re.match(r"^Kernel\w*\{\}$", text):
                    params["kernel"] = text[:-2]
                elif text.startswith("Option<"):
                    params["options"] = f"{params['options']}, {text}" if "options" in params else text
            stmt = call.parent if call.parent is not None else call
            cond = " && ".join(_conditions(stmt, fn, f))
            out.append(("", head_dim, "any", params, cond, stmt.start_point.row + 1, stmt.end_point.row + 1,
                        "" if direction == "fwd" else "_bwd"))
    return out
