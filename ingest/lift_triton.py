"""Lift Triton attention kernels into complete, executable IR Programs (checked by the interpreter).

`lift_file(path, provenance_base)` parses the file with `ast` (never imports it), finds the
`@triton.jit` kernels, and for every supported combination of feature flags (causal, ALiBi):
1. specializes constexpr `if`s and inlines jit helpers (`ingest.triton_source`);
2. walks the kernel symbolically (`ingest.triton_exec`): index math becomes IR expressions,
   tile operations become idiom events with their source lines;
3. finds the launch grid roles (batch / head / query block / split) from the strides the
   q pointer uses, and walks again with those roles bound to IR grid variables;
4. assembles the FlashAttention structure from the recognized idioms: q tile load, KV loops
   with the source's bounds (block skipping, full/masked loop split), score scaling, masks
   (`tl.where(..., -inf)` -> mask_mod), additive score terms (ALiBi -> score_mod, with log2
   units folded back to natural ones), the online-softmax update, the epilogue, and for a
   split-KV kernel plus a reduce kernel, the LSE combine;
5. validates (`kb.ir.validate`) and runs the program in the interpreter against dense torch.

Invariants: a program is only returned with `verified=True` if the interpreter matched the
dense reference on ragged shapes; anything the walk could not translate is listed in the
report's `skipped` with its line; no hard-coded file names or templates: a kernel without the
idioms is skipped with the missing idioms named.
"""

from __future__ import annotations

import ast
import copy
import itertools
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path


from kb.errors import KBError
from kb.features import Features
from kb.ir.features import derive_features
from kb.ir.expr import (Expr, ExprOp, call, const, free_vars, loaded_tensors, parse_expr as E, substitute, var,
                        walk as walk_expr)
from kb.ir.nodes import (
    Combine, Dot, Dtype, Elementwise, Finalize, For, Full, Gather, GridAxis, Index, Init, Kernel, Let, Load, Mask,
    OnlineSoftmax, Param, Program, Role, Schedule, ScoreMod, Span, Store, TileAt, VariantFn, MASK_MOD_PARAMS,
    SCORE_MOD_PARAMS,
)
from kb.ir.validate import validate
from ingest.lift_triton_bwd import lift_backward  # backward kernels: recognised by dataflow, in their own module
from ingest.model import LiftedProgram, LiftedSnippet, LiftedTunable, LiftReport, Provenance, as_int
from ingest.triton_flags import flag_values, merge_skips
from ingest.triton_dims import infer_dims
from ingest.lift_verify import resolved_let, verify_decode, verify_packed, verify_program
from ingest.triton_layout import DENSE, Layout, split_start
from ingest.triton_regions import serving_regions
from ingest.triton_exec import LOG2E, Event, KernelWalk, Loop, lane_to_idx, stride_indices, walk_kernel
from ingest.triton_source import JitFn, TritonModule, parse_module, specialize
from kb.ir.algebra import conjunction, conjuncts, from_poly, min_of, normal_compare, normal_form, scale_poly, to_poly

__all__ = ["LiftedProgram", "lift_file", "lift_module", "verify_program", "verify_packed", "verify_decode",
           "LIFTER_VERSION"]

log = logging.getLogger(__name__)
LIFTER_VERSION = "triton-ast-1"
_DIMS = {"B", "Hq", "Hkv", "M", "N", "D", "BLOCK_M", "BLOCK_N", "NUM_SPLITS", "HEAD_PAD"}


class _Skip(Exception):
    """This kernel/flag combination cannot become a Program; the message says why."""


@dataclass
class _Ctx:
    mod: TritonModule
    base: Provenance
    family: str
    snippets: list[LiftedSnippet] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seen_snippets: set = field(default_factory=set)
    backward: set = field(default_factory=set)  # kernels ingest.lift_triton_bwd took (their configs are theirs)


# ---------------------------------------------------------------- provenance + snippets


def _prov(ctx: _Ctx, start: int, end: int, file: str | None = None) -> Provenance:
    return replace(ctx.base, file=file or ctx.base.file, line_start=start, line_end=max(start, end),
                   lifter="triton", lifter_version=LIFTER_VERSION)


def _text(ctx: _Ctx, start: int, end: int, file: str | None) -> str:
    lines = ctx.mod.lines
    if file and file != ctx.base.file:
        p = ctx.mod.path.parent / Path(file).name
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines() if p.exists() else []
    return "\n".join(lines[start - 1:end])


def _snippet(ctx: _Ctx, kind: str, title: str, ir_text: str, start: int, end: int, file: str | None = None,
             features: dict | None = None) -> None:
    key = (kind, file or ctx.base.file, start, end)
    if key in ctx.seen_snippets or start <= 0:
        return
    ctx.seen_snippets.add(key)
    ctx.snippets.append(LiftedSnippet(kind, title, ir_text, _text(ctx, start, end, file), features or {},
                                      _prov(ctx, start, end, file)))


# ---------------------------------------------------------------- flags + tunables


def _block_keys(ctx: _Ctx, kernel: str) -> dict[str, str]:
    """Config / launch keywords that set the block sizes: the parameters used as BLOCK_M / BLOCK_N
    (`ingest.triton_dims`), and the names BLOCK_M / BLOCK_N themselves for configs of other kernels."""
    keys = {"BLOCK_M": "block_m", "BLOCK_N": "block_n"}
    fn = ctx.mod.jit.get(kernel)
    if fn is not None:
        dims = infer_dims(fn.node, fn.node.body, {})
        keys |= {p: d.lower() for p, d in dims.items() if d in ("BLOCK_M", "BLOCK_N")}
    return keys


def _tunables(ctx: _Ctx, kernel: str) -> list[LiftedTunable]:
    out: list[LiftedTunable] = []
    keys = _block_keys(ctx, kernel)
    for c in ctx.mod.configs:
        if c.function in ctx.backward:
            continue
        params = {keys.get(k, k): v for k, v in c.params.items()}
        arch = "cdna" if "cdna" in c.function else "rdna" if "rdna" in c.function else "any"
        out.append(LiftedTunable(ctx.family, arch, 0, "any", params, f"{c.function}()", _prov(ctx, c.line, c.line)))
    for site in ctx.mod.launches:
        if site.kernel != kernel:
            continue
        params = {keys.get(k, k): v for k, v in site.constants.items()
                  if k in keys or k in ("num_warps", "num_stages", "waves_per_eu")}
        for k in ("num_warps", "num_stages"):
            if k not in params and k in site.keyword_exprs:
                params[k] = site.keyword_exprs[k]
        if params:
            out.append(LiftedTunable(ctx.family, "any", 0, "any", params, f"launch of {kernel}", _prov(ctx, site.line, site.line)))
    return out


def _default_schedule(ctx: _Ctx, kernel: str, tunables: list[LiftedTunable]) -> tuple[Schedule, str]:
    """The default config: launch constants if the launch fixes blocks, else the arch-neutral autotune config."""
    launch = [t for t in tunables if t.condition == f"launch of {kernel}" and "block_m" in t.params]
    neutral = [t for t in tunables if t.condition.endswith("()") and t.arch == "any"]
    pick = next(iter(launch or neutral or [t for t in tunables if t.condition.endswith("()")]), None)
    if pick is None:
        return Schedule(block_m=64, block_n=64, num_warps=4, num_stages=1), "no config found: 64x64 default"
    p = pick.params
    nw = p.get("num_warps", 4)
    sched = Schedule(block_m=as_int(p.get("block_m", 64)), block_n=as_int(p.get("block_n", 64)),
                     num_warps=nw if isinstance(nw, int) else 4, num_stages=as_int(p.get("num_stages", 1)))
    return sched, f"schedule from {pick.condition} (line {pick.provenance.line_start})"


# ---------------------------------------------------------------- roles


def _loads(walk: KernelWalk, base: str) -> list[Event]:
    evs = walk.events + [e for lp in walk.loops for e in lp.events]
    return [e for e in evs if e.kind == "load" and e.loaded()[0] == base]


@dataclass
class _Roles:
    """What the first walk says about the grid: source names and values to bind on the second walk."""

    overrides: dict[str, Expr] = field(default_factory=dict)  # program ids / params -> IR names
    values: dict[Expr, Expr] = field(default_factory=dict)  # e.g. `pid1 // n_heads` -> b
    found: dict[str, str] = field(default_factory=dict)  # role -> program id


def _resolve(e: Expr, walk: KernelWalk) -> Expr:
    """`e` with the walk's lets substituted (innermost first), simplified."""
    env: dict[str, Expr] = {}
    for item in walk.lets:
        if item[0] == "let":
            env[item[1]] = substitute(item[2], env)
    return normal_form(substitute(e, env))


def _terms(walk: KernelWalk, base: str) -> list[tuple[str, Expr]]:
    loads = _loads(walk, base)
    if not loads:
        raise _Skip(f"no tile load of {base}")
    return stride_indices(_resolve(loads[0].loaded()[1], walk))


def _pid(e: Expr) -> str | None:
    return str(e.value) if e.op is ExprOp.VAR and re.fullmatch(r"pid\d", str(e.value)) else None


def _param_var(e: Expr, walk: KernelWalk) -> str | None:
    """The name of a kernel parameter whose role is not known yet, if `e` is just that."""
    return str(e.value) if e.op is ExprOp.VAR and walk.params.get(str(e.value)) == "scalar" else None


def _split_roles(roles: _Roles, walk: KernelWalk, idx: Expr, stride: str) -> str | None:
    """A fused batch*head program id: `pid // H` is the batch index, `pid % H` the head; H is Hq."""
    if idx.op not in (ExprOp.FLOORDIV, ExprOp.MOD) or _pid(idx.args[0]) is None:
        return None
    count = _param_var(idx.args[1], walk)
    if count is not None:
        roles.overrides[count] = var("Hq")
    role = "b" if idx.op is ExprOp.FLOORDIV else "h"
    roles.values[idx] = var(role)
    roles.found[role] = _pid(idx.args[0])  # type: ignore[assignment]
    return role


def _unfused_roles(roles: _Roles, pids: list[tuple[str, str]], k_terms: list[tuple[str, Expr]]) -> None:
    """Whole program ids indexing q: the one the KV head is derived from (`pid // group`) is the head.

    Without GQA nothing in the kernel tells batch from head; the choice does not change the program
    (both are plain grid axes), so the stride's name is used as a hint (`*b`/`*z` batch, `*h` head),
    then the lower axis is taken as the head.
    """
    k_idx = [idx for _, idx in k_terms]  # a program id inside a table load looks up the sequence: not the head
    derived = [pid for pid, _ in pids if any(pid in _outside_loads(i) and i != var(pid) for i in k_idx)]
    need = [r for r in ("h", "b") if r not in roles.found]
    if derived and "h" in need and len(derived) == 1:
        roles.found["h"] = derived[0]
    for pid, stride in sorted(pids, key=lambda t: t[0]):
        if pid in roles.found.values():
            continue
        hint = "b" if stride[-1:] in ("b", "z") else "h" if stride[-1:] == "h" else None
        free = [r for r in ("h", "b") if r not in roles.found]
        if free:
            roles.found[hint if hint in free else free[0]] = pid
    for role in ("b", "h"):
        if any(pid == roles.found.get(role) for pid, _ in pids):
            roles.overrides[roles.found[role]] = var(role)


def _outside_loads(e: Expr) -> set[str]:
    """The variables of `e` that are not inside a table load's index."""
    if e.op is ExprOp.LOAD:
        return set()
    if e.op is ExprOp.VAR:
        return {str(e.value)}
    return set().union(*(_outside_loads(a) for a in e.args)) if e.args else set()


def _roles(walk: KernelWalk, q_base: str, k_base: str) -> _Roles:
    """Grid roles from how the q pointer is indexed: rows (lane `_r`) give the query-block program id,
    the remaining program-id terms give batch and head (split of a fused axis, or whole axes)."""
    roles = _Roles()
    whole: list[tuple[str, str]] = []
    for stride, idx in _terms(walk, q_base):
        start, idx = split_start(idx) if "_r" in free_vars(idx) else (None, idx)
        if start is not None:  # packed tokens: start(b) + row; the program id indexing the start table is b
            table_pids = sorted(free_vars(start) & {"pid0", "pid1", "pid2"})
            if len(table_pids) != 1:
                raise _Skip(f"sequence start {start} is not read at one program_id")
            roles.overrides[table_pids[0]], roles.found["b"] = var("b"), table_pids[0]
        pids = sorted(free_vars(idx) & {"pid0", "pid1", "pid2"})
        if not pids or "_d" in free_vars(idx) or "_c" in free_vars(idx):
            continue
        if "_r" in free_vars(idx):
            if len(pids) != 1:
                raise _Skip(f"query-row index {idx} does not come from one program_id")
            roles.overrides[pids[0]], roles.found["m"] = var("m"), pids[0]
        elif _pid(idx) is not None:
            whole.append((pids[0], stride))
        elif _split_roles(roles, walk, idx, stride) is None:
            raise _Skip(f"q pointer index {idx} (stride {stride or 1}) is not a program id or a split of one")
    grouped = _grouped_pid(roles, _terms(walk, k_base))
    if grouped is not None:  # the q rows are the query heads of a KV head group: the row axis is the group `g`
        del roles.found["m"]
        roles.found["h"], roles.overrides[grouped] = grouped, var("g")
    _unfused_roles(roles, whole, _terms(walk, k_base))
    decode = grouped is not None or not any("_r" in free_vars(idx) for _, idx in _terms(walk, q_base))
    missing = ({"b", "h"} | (set() if decode else {"m"})) - set(roles.found)
    if missing:
        raise _Skip(f"grid roles {sorted(missing)} not found in the q pointer (terms: {_terms(walk, q_base)})")
    roles.values = {normal_form(substitute(k, roles.overrides)): v for k, v in roles.values.items()}
    return roles


def _grouped_pid(roles: _Roles, k_terms: list[tuple[str, Expr]]) -> str | None:
    """The q row program id when the KV head is derived from it (`kv_head = pid // cdiv(G, BLOCK_H)`): the q
    tile's rows are then query heads sharing a KV head (a grouped decode), not query tokens."""
    pid = roles.found.get("m")
    heads = [idx for _, idx in k_terms if not free_vars(idx) & {"_c", "_d", "_r"}]
    return pid if pid is not None and any(pid in _outside_loads(i) and i != var(pid) for i in heads) else None


def _grouped_sizes(walk: KernelWalk, k_base: str, names: set[str]) -> dict[str, Expr]:
    """Grouped decode sizes (on a walk with program id `g` and the size parameters under their own names):
    X in the KV head `g // cdiv(X, BLOCK_M)` is the group size Hq // Hkv; another parameter bounding the
    head rows (`row < Y` in the score mask) is Hq."""
    out: dict[str, Expr] = {}
    for _, idx in _terms(walk, k_base):
        for sub in walk_expr(idx):
            if sub.op is ExprOp.FLOORDIV and sub.args[0] == var("g") and sub.args[1].op is ExprOp.CDIV \
                    and sub.args[1].args[0].op is ExprOp.VAR:
                out[str(sub.args[1].args[0].value)] = E("Hq // Hkv")
    for e in _events(walk, "mask"):
        for c in conjuncts(e.expr()):
            if c.op is ExprOp.LT and "_r" in free_vars(c.args[0]) and c.args[1].op is ExprOp.VAR \
                    and str(c.args[1].value) in names - set(out):
                out[str(c.args[1].value)] = var("Hq")
    return out


def _kv_roles(walk: KernelWalk, k_base: str, roles: _Roles) -> None:
    """The KV head count from the KV head index: `h // (X // Y)` makes X Hq and Y Hkv; `h // G` makes G Hq // Hkv."""
    heads = [var("h")] + [k for k, v in roles.values.items() if v == var("h")]
    for _, idx in _terms(walk, k_base):
        for sub in walk_expr(normal_form(substitute(idx, roles.overrides))):
            if sub.op is not ExprOp.FLOORDIV or sub.args[0] not in heads:
                continue
            ratio = sub.args[1]
            if ratio.op is ExprOp.FLOORDIV and _param_var(ratio.args[1], walk):
                roles.overrides[str(ratio.args[1].value)] = var("Hkv")
                if _param_var(ratio.args[0], walk):
                    roles.overrides[str(ratio.args[0].value)] = var("Hq")
            elif _param_var(ratio, walk):
                roles.overrides[str(ratio.value)] = E("Hq // Hkv")


def _row_term(offset: Expr) -> tuple[Expr | None, Expr | None]:
    """(sequence start, row index) of a pointer offset's row term; (None, None) without one row term."""
    rows = [idx for _, idx in stride_indices(normal_form(offset)) or () if {"_r", "_c"} & free_vars(idx)]
    return split_start(rows[0]) if len(rows) == 1 else (None, None)


def _layout(walk: KernelWalk, q_base: str, k_base: str) -> Layout:
    """Dense, or packed tokens with the sequence start read off the q pointer and the length off the KV masks.

    Packed k and v tiles must read rows `start + kv_idx` of the same sequence (self-attention)."""
    q_loads = _loads(walk, q_base)
    if q_loads and "g" in free_vars(_resolve(q_loads[0].loaded()[1], walk)):
        return _grouped_layout(walk, q_loads[0], k_base)
    if q_loads and "_r" not in free_vars(q_loads[0].loaded()[1]):
        strided = [str(i) for st, i in stride_indices(_resolve(q_loads[0].loaded()[1], walk)) if st and "_d" in free_vars(i)]
        if strided:  # e.g. the query heads of a grouped decode tile: not one q row per (b, h)
            raise _Skip(f"line {q_loads[0].line}: decode q tile has lanes beyond the head dim ({', '.join(strided)})")
        return _decode_layout(walk, k_base)
    start = _row_term(q_loads[0].loaded()[1])[0] if q_loads else None
    if start is None:
        return DENSE
    v_bases = {e.name() for lp in walk.loops for e in lp.events if e.kind == "pv_dot"}
    for lp in walk.loops:
        for e in lp.events:
            if e.kind == "load" and e.loaded()[0] in {k_base} | v_bases:
                at, row = _row_term(e.loaded()[1])
                if at != start or row is None or lane_to_idx(row, lp.var) != var("kv_idx"):
                    raise _Skip(f"line {e.line}: packed {e.loaded()[0]} rows are not {start} + kv_idx "
                                f"(only self-attention over packed sequences lifts)")
    for lp in walk.loops:
        for e in lp.events:
            if e.kind != "mask":
                continue
            for c in conjuncts(lane_to_idx(e.expr(), lp.var)):
                if c.op is ExprOp.LT:
                    c = normal_compare(c.op, c.args[0], c.args[1])
                    if c.args[0] == var("kv_idx") and any(x.op is ExprOp.LOAD for x in walk_expr(c.args[1])):
                        return Layout(start, c.args[1])
    raise _Skip(f"packed rows from {start}, but no per-sequence length bounds the keys (kv_idx < length[b])")


def _grouped_layout(walk: KernelWalk, q_load: Event, k_base: str) -> Layout:
    """A decode tile over the query heads of group `g`: the head rows `h0 + lane` bounded in the score mask
    (`h0 + lane < Y`) give the first head `h0` and the end (`until`), and the q pointer must step by them
    along its `lane` stride; KV rows as for a decode row."""
    offset = _resolve(q_load.loaded()[1], walk)
    strides = [st for st, idx in stride_indices(offset) if idx == var("_r")]
    conds = [c for e in _events(walk, "mask") for c in conjuncts(_resolve(e.expr(), walk))
             if c.op is ExprOp.LT and "_r" in free_vars(c.args[0]) and "_c" not in free_vars(c)]
    rows = list(dict.fromkeys(c.args[0] for c in conds))
    if len(strides) != 1 or len(rows) != 1:
        raise _Skip(f"line {q_load.line}: no single bound head-row term in a grouped q tile (rows {[str(r) for r in rows]})")
    head0 = normal_form(substitute(rows[0], {"_r": const(0)}))
    rest = normal_form(Expr(ExprOp.SUB, (offset, Expr(ExprOp.MUL, (rows[0], E(strides[0] or "1"))))))
    if {"_r", "g"} & free_vars(rest) or normal_form(substitute(head0, {"g": const(0)})) != const(0):
        raise _Skip(f"line {q_load.line}: the q pointer does not step by the group's head rows {rows[0]}")
    until = min_of(list(dict.fromkeys(c.args[1] for c in conds)))
    return replace(_decode_layout(walk, k_base), head0=head0, heads_until=until)


def _kv_row(e: Event, lp: Loop, walk: KernelWalk) -> Expr:
    """The pool row of KV lane `j` in a gathered k/v load: the row term (the one with the lane `_c`), or
    `page * P + token` for a page term beside a `X % P` token term (a page cache read as flattened rows)."""
    rows = [idx for _, idx in stride_indices(_resolve(e.loaded()[1], walk)) if "_c" in free_vars(idx)]
    tok = [r for r in rows if r.op is ExprOp.MOD]
    if len(rows) == 2 and len(tok) == 1:
        page = next(r for r in rows if r is not tok[0])
        rows = [Expr(ExprOp.ADD, (Expr(ExprOp.MUL, (page, tok[0].args[1])), tok[0]))]
    if len(rows) != 1 or not any(x.op is ExprOp.LOAD for x in walk_expr(rows[0])):
        raise _Skip(f"line {e.line}: {e.loaded()[0]} rows {[str(r) for r in rows]} are not one table lookup per KV lane")
    return normal_form(substitute(rows[0], {"_c": var("j")}))


def _split_free(bound: Expr) -> Expr:
    """The sequence length in a split's KV end `minimum(split_start + chunk, length)`: the operand free of `s`."""
    if bound.op is ExprOp.MINIMUM:
        free = [a for a in bound.args if "s" not in free_vars(a)]
        if len(free) == 1:
            return _split_free(free[0])
    return bound


def _decode_layout(walk: KernelWalk, k_base: str) -> Layout:
    """One q row per (b, h); k and v lanes gathered at the same table row, bounded by the sequence length."""
    v_bases = {e.name() for lp in walk.loops for e in lp.events if e.kind == "pv_dot"}
    rows: dict[str, Expr] = {}
    length = None
    for lp in walk.loops:
        for e in lp.events:
            if e.kind == "load" and e.loaded()[0] in {k_base} | v_bases:
                rows[e.loaded()[0]] = _kv_row(e, lp, walk)
            if e.kind == "mask" and length is None:
                for c in conjuncts(lane_to_idx(e.expr(), lp.var)):
                    c = normal_compare(c.op, c.args[0], c.args[1]) if c.op is ExprOp.LT else c
                    if c.op is ExprOp.LT and c.args[0] == var("kv_idx"):
                        length = _split_free(c.args[1])
    if len(set(rows.values())) != 1:
        raise _Skip(f"decode k and v rows differ: {', '.join(f'{b}: {r}' for b, r in rows.items())}")
    if length is None or not any(x.op is ExprOp.LOAD for x in walk_expr(length)):
        raise _Skip(f"decode over gathered rows, but no per-sequence length bounds the keys (got {length})")
    row = next(iter(rows.values()))
    sizes = tuple(Param(n, (), Dtype.I32, Role.SCALAR) for n in sorted(free_vars(row)) if walk.params.get(n) == "scalar")
    return Layout(length=length, kv_row=row, tables=_table_params(row, length) + sizes)  # sizes: the page size


def _table_params(*exprs: Expr) -> tuple[Param, ...]:
    """Integer tables loaded by the row and length expressions: an axis always indexed by `b` is B."""
    uses: dict[str, list[tuple[Expr, ...]]] = {}
    for e in exprs:
        for x in walk_expr(e):
            if x.op is ExprOp.LOAD:
                uses.setdefault(str(x.value), []).append(x.args)
    out = []
    for name, idxs in sorted(uses.items()):
        rank = len(idxs[0])
        if any(len(i) != rank for i in idxs):
            raise _Skip(f"table {name} is indexed with {sorted({len(i) for i in idxs})} indices")
        dims = tuple("B" if all(i[a] == var("b") for i in idxs) else f"{name.upper()}_{a}" for a in range(rank))
        out.append(Param(name, dims, Dtype.I32, Role.AUX))
    return tuple(out)


def _kv_head(walk: KernelWalk, k_base: str) -> Expr:
    """The index of the k pointer that mentions the q head `h` (through the walk's lets)."""
    loads = _loads(walk, k_base)
    if not loads:
        raise _Skip("k pointer offset not understood")
    lets = {str(it[1]) for it in walk.lets if it[0] == "let"}
    heads = [idx for _, idx in stride_indices(normal_form(loads[0].loaded()[1]), lets)
             if {"h", "g"} & free_vars(_resolve(idx, walk)) and not free_vars(idx) & {"_c", "_d", "_r"}]
    if len(heads) == 1:
        return heads[0]
    # a let that mixes head and rows (`row0 = (b * H + h) * N` of a flattened view): decompose with lets substituted
    heads = [idx for _, idx in stride_indices(_resolve(loads[0].loaded()[1], walk))
             if {"h", "g"} & free_vars(idx) and not free_vars(idx) & {"_c", "_d", "_r"}]
    if len(heads) != 1:
        raise _Skip(f"no single head index in the k pointer ({len(heads)} found)")
    return heads[0]


# ---------------------------------------------------------------- assembly


@dataclass
class _Lifted:
    kernels: tuple[Kernel, ...]
    params: tuple[Param, ...]
    schedule_splits: int
    score_mod: Expr | None
    mask_mod: Expr | None
    notes: list[str]
    spans: list[tuple[str, str, int, int, str | None]]  # (kind, ir_text, start, end, file)


def _events(walk: KernelWalk, kind: str) -> list[Event]:
    return [e for e in walk.events + [x for lp in walk.loops for x in lp.events] if e.kind == kind]


def _check_names(e: Expr, allowed: set[str], what: str) -> None:
    bad = free_vars(e) - allowed
    if bad:
        raise _Skip(f"{what} {e} uses names the IR cannot bind: {sorted(bad)}")


def _launched_in_log2(ctx: _Ctx, fn: JitFn, walk: KernelWalk, overrides: dict[str, Expr]) -> bool:
    """Every launch passes the softmax scale already multiplied by log2(e) (vLLM: `sm_scale *= RCP_LN2`)."""
    names = [a.arg for a in fn.node.args.args]
    scale_params = {p for p, role in walk.params.items() if role == "scale"} | \
        {p for p, value in overrides.items() if value == var("sm_scale")}  # named so, or found by use
    scale = [names.index(p) for p in scale_params if p in names]
    sites = [site for site in ctx.mod.launches if site.kernel == fn.name]
    if len(scale) != 1 or not sites:
        return False
    at = scale[0]
    return all(at < len(site.args) and site.args[at] is not None
               and abs(site.factors.get(site.args[at], 1.0) - LOG2E) < 1e-6 for site in sites)


def _log2_units(walk: KernelWalk) -> bool:
    for e in _events(walk, "scale"):
        for mono, c in to_poly(e.expr()).items():
            if var("sm_scale") in mono and abs(abs(c) - LOG2E) < 1e-6:
                return True
    return False


def _loop_ir(lp: Loop, walk: KernelWalk, log2: bool, mask_terms: list[Expr], score_terms: list[Expr],
             notes: list[str], spans: list, layout: Layout = DENSE) -> tuple:
    kinds = {e.kind for e in lp.events}
    needed = {"score_dot", "pv_dot", "rowmax", "rowsum", "rescale"}
    missing = needed - kinds
    if not ({"exp", "exp2"} & kinds):
        missing.add("exp/exp2")
    if missing:
        raise _Skip(f"KV loop at line {lp.line}: online-softmax idioms missing: {sorted(missing)}")
    for e in lp.events:
        if e.kind == "exp2" and not (log2 or "log2e" in e.deps()):
            raise _Skip(f"line {e.line}: exp2 on natural-log scores (no log2(e) folding found)")
        if e.kind == "exp" and log2:
            raise _Skip(f"line {e.line}: exp on log2-scaled scores")
    masked, uses_mod = False, False
    for e in lp.events:
        if e.kind == "mask" and layout.grouped and (cond := _kvconjuncts(e)) is not None:
            e = replace(e, payload=cond)
        elif e.kind == "mask" and layout.grouped:  # only the bounds of the group's head rows
            continue
        if e.kind == "score_term" and layout.grouped:
            raise _Skip(f"line {e.line}: an additive score term (ALiBi, bias) in a grouped decode tile: the IR has one "
                        f"head `h` per tile, its variant functions cannot read the head of each row")
        if e.kind == "mask":
            cond = lane_to_idx(e.expr(), lp.var)
            if cond.op in (ExprOp.LT, ExprOp.LE, ExprOp.GT, ExprOp.GE, ExprOp.EQ, ExprOp.NE):
                cond = normal_compare(cond.op, cond.args[0], cond.args[1])
            fv = free_vars(cond)
            if "q_idx" in fv:
                _check_names(cond, {"q_idx", "kv_idx", "b", "h"} | _DIMS, "mask")
                if e.cond is not None:
                    raise _Skip(f"line {e.line}: mask_mod applied under a runtime condition {e.cond}")
                if cond not in mask_terms:
                    mask_terms.append(cond)
                uses_mod = True
                spans.append(("mask_causal", str(cond), e.line, e.line, e.file))
            elif "kv_idx" in fv and (layout.packed or layout.decode):  # no dim N: the sequence's length bounds kv
                if layout.decode:  # a split's end: the length here, the split's range in the loop bounds
                    assert layout.length is not None
                    cond = normal_compare(ExprOp.LT, var("kv_idx"), layout.length)
                _check_names(cond, {"kv_idx", "b", "h"} | _DIMS, "mask")
                if cond not in mask_terms:
                    mask_terms.append(cond)
                uses_mod = True
                spans.append(("mask_bounds", str(cond), e.line, e.line, e.file))
            elif "kv_idx" in fv:
                if cond != normal_compare(ExprOp.LT, var("kv_idx"), var("N")):
                    notes.append(f"line {e.line}: kv range mask {cond} is covered by the IR's kv_idx < N mask and "
                                 f"the loop bounds (per-split ends rounded to BLOCK_N)")
                spans.append(("mask_bounds", str(cond), e.line, e.line, e.file))
            else:
                raise _Skip(f"line {e.line}: mask condition {cond} has no kv/q index")
            masked = True
        elif e.kind == "score_term":
            term = lane_to_idx(e.expr(), lp.var)
            if log2:
                term = from_poly(scale_poly(to_poly(term), 1 / LOG2E))
            _check_names(term, {"q_idx", "kv_idx", "b", "h"} | _DIMS, "score term")
            if term not in score_terms:
                score_terms.append(term)
            spans.append(("alibi", str(term), e.line, e.line, e.file))
    n = var(lp.var)
    q_at = E("kv_len - 1") if layout.decode else var("m_start")  # a decode row is the sequence's last token
    head = var("h0" if layout.grouped else "h")
    body: list = [
        Load("kt", "k", layout.kv("hk", n)),
        Load("vt", "v", layout.kv("hk", n)),
        Dot("qk", "qt", "kt", trans_b=True),
        Elementwise("qk", E("qk * sm_scale")),
    ]
    if score_terms:
        body.append(ScoreMod("qk", TileAt(var("b"), head, q_at, n)))
    if masked:
        body.append(Mask("qk", TileAt(var("b"), head, q_at, n), use_mask_mod=uses_mod))
    body.append(OnlineSoftmax("m_i", "l_i", "acc", "qk", "vt"))
    first = min(e.line for e in lp.events if e.kind in ("rowmax",))
    last = max(e.line for e in lp.events if e.kind in ("pv_dot",))
    spans.append(("online_softmax", "online_softmax (m_i, l_i, acc) += qk @ vt", first, last,
                  next(e.file for e in lp.events if e.kind == "rowmax")))
    spans.append(("kv_loop_bounds", f"for {lp.var} in range({lp.lo}, {lp.hi}, BLOCK_N) forward:", lp.line, lp.line,
                  next((e.file for e in lp.events), None)))
    for e in lp.events:
        if e.kind in ("score_dot", "pv_dot"):
            spans.append(("score_mod" if e.kind == "score_dot" else "softmax_rescale",
                          "dot qk = qt @ trans(kt)" if e.kind == "score_dot" else "online_softmax (m_i, l_i, acc) += qk @ vt",
                          e.line, e.line, e.file))
    lo, hi = (var("lo"), var("hi")) if layout.decode and "s" in free_vars(lp.hi) else (lp.lo, lp.hi)
    return For(lp.var, lo, hi, "BLOCK_N", "forward", tuple(body)), uses_mod


def _kvconjuncts(e: Event) -> Expr | None:
    """A grouped decode's score mask without the bounds of its head rows (the q span's `until`); None when only
    those remain. A condition mixing head rows and keys (a per-head window, a sink) is refused."""
    keep = []
    for c in conjuncts(e.expr()):
        lanes = free_vars(c) & {"_r", "_c"}
        if lanes == {"_r", "_c"}:
            raise _Skip(f"line {e.line}: mask {c} reads each row's head in a grouped decode tile: the IR has one "
                        f"head `h` per tile")
        if lanes != {"_r"}:
            keep.append(c)
    return conjunction(keep)


def _assemble(ctx: _Ctx, walk: KernelWalk, hk: Expr, split_axis: str | None, layout: Layout = DENSE,
              launched_log2: bool = False) -> _Lifted:
    notes: list[str] = []
    spans: list = []
    log2 = _log2_units(walk) or launched_log2
    if launched_log2:
        notes.append("the launcher multiplies the softmax scale by log2(e) before the launch: the kernel's scale "
                     "parameter is in log2 units; the IR's sm_scale is the natural one")
    if not _events(walk, "scale"):
        raise _Skip("no multiplication of the scores by the softmax scale parameter")
    if not walk.loops:
        raise _Skip("no loop over KV blocks (range(lo, hi, BLOCK_N) with tl.dot)")
    mask_terms: list[Expr] = []
    score_terms: list[Expr] = []
    lets: list = [Let("m_start", E("m * BLOCK_M"))]
    if layout.grouped:
        assert layout.head0 is not None
        lets += [Let("h0", layout.head0)]
    if layout.decode:
        assert layout.length is not None
        lets += [Let("kv_len", layout.length)]
        if any(t.role is Role.SCALAR for t in layout.tables):
            notes.append("page cache read as flattened token rows [pages * PAGE_SIZE, Hkv, D]: the source's page "
                         "stride is taken to be PAGE_SIZE token strides (a contiguous cache)")
        if split_axis is not None:  # the IR's split ranges: chunks of whole KV blocks (docs/lift_triton.md)
            lets += [Let("chunk", E("cdiv(cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N")), Let("lo", E("s * chunk")),
                     Let("hi", E("minimum(lo + chunk, kv_len)"))]
            notes.append("decode split ranges: the IR splits kv_len into NUM_SPLITS chunks of whole KV blocks; the "
                         "source's own split lengths (and per-sequence split counts) give other partials, the same "
                         "combined result")
    if layout.packed:
        if split_axis is not None:
            raise _Skip("split-KV over packed sequences: not lifted yet")
        assert layout.start is not None and layout.length is not None
        lets += [Let("q0", layout.start), Let("q_len", layout.length)]
    rows: int | str = 1 if layout.decode and not layout.grouped else "BLOCK_M"
    prologue = [
        Let("hk", normal_form(hk)),
        Load("qt", "q", layout.rows("h", var("m_start"), "BLOCK_M")),
        Init("m_i", (rows,), float("-inf"), Dtype.F32),
        Init("l_i", (rows,), 0.0, Dtype.F32),
        Init("acc", (rows, "HEAD_PAD"), 0.0, Dtype.F32),
    ]
    body: list = list(lets)
    placed = False
    for item in walk.lets:
        if item[0] == "let":
            body.append(Let(item[1], item[2]))
            continue
        lp: Loop = item[1]
        if not any(e.kind == "score_dot" for e in lp.events):
            raise _Skip(f"loop at line {lp.line} has no score dot")
        if not placed:
            body.extend(prologue)
            placed = True
        loop, _ = _loop_ir(lp, walk, log2, mask_terms, score_terms, notes, spans, layout)
        body.append(loop)
    # epilogue: stores at kernel scope
    stores = [e for e in walk.events if e.kind == "store"]
    o_stores = [e for e in stores if "pv" in e.stored()[1]]
    stat_stores = [e for e in stores if "pv" not in e.stored()[1] and ({"rowsum", "rowmax"} & e.stored()[1])]
    if not o_stores:
        raise _Skip("no store of the accumulator")
    normalized = "rowsum" in o_stores[0].stored()[1]
    for e in stat_stores:
        if "log2" in e.stored()[1] and "ln2" not in e.stored()[1]:
            raise _Skip(f"line {e.line}: LSE stored in log2 units")
    spans.append(("epilogue", "finalize ot, lt = (m_i, l_i, acc)", min(e.line for e in stores),
                  max(e.line for e in stores), o_stores[0].file))
    for e in _events(walk, "finite_fill"):
        notes.append(f"line {e.line}: masked scores are set to {e.payload:g}, not -inf: the same result unless a row "
                     f"allows no key (the source then averages v; the IR gives o = 0, lse = -inf)")
    for e in _events(walk, "where_tile"):
        notes.append(f"line {e.line}: tile-level tl.where outside the masks (NaN/fully-masked-row guard): "
                     f"the IR's finalize gives o = 0, lse = -inf for fully masked rows")
    flat = sorted({e.line for e in _events(walk, "flat_desc")})
    if flat:
        notes.append(f"lines {flat}: 2-D tensor descriptors over flattened [batch * heads * seq, D] rows: the source reads "
                     f"(and stores) rows past a sequence's end in the next (b, h) slice, so it matches the IR (which "
                     f"bounds each sequence) only when M and N are multiples of BLOCK_M and BLOCK_N")
    if walk.early_exits:
        notes.append(f"early exit at lines {walk.early_exits}: fully masked query blocks (the IR runs the empty loop)")
    body.append(Finalize("ot", "lt", "m_i", "l_i", "acc"))
    params = layout.params() + [Param("sm_scale", (), Dtype.F32, Role.SCALAR)]
    tables: frozenset[str] = frozenset()
    if layout.packed:
        assert layout.start is not None and layout.length is not None
        tables = loaded_tensors(layout.start) | loaded_tensors(layout.length)
    for e in _events(walk, "aux_load"):
        base, idx = e.indexed()
        if any(t.name == base.lower() for t in layout.tables):
            continue
        dims = tuple({"b": "B", "h": "Hq"}.get(str(i), "?") for _, i in idx)
        if "?" in dims:
            raise _Skip(f"line {e.line}: auxiliary load {base}{[str(i) for _, i in idx]} not indexed by (b, h)")
        if not any(p.name == base.lower() for p in params):  # sequence offsets and lengths are integers
            params.append(Param(base.lower(), dims, Dtype.I32 if base.lower() in tables else Dtype.F32, Role.AUX))
    grid: tuple[GridAxis, ...] = (GridAxis("b", E("B")), GridAxis("h", E("Hq")))
    grid += () if layout.decode else (GridAxis("m", layout.query_blocks()),)
    kernels: tuple[Kernel, ...]
    if split_axis is not None and layout.decode:
        kernels = _decode_split_kernels(grid, body, params, layout)
    elif split_axis is None:
        if not normalized:
            raise _Skip("accumulator stored without normalization and no split-KV combine kernel")
        body += [Store("o", layout.rows("h", var("m_start"), "BLOCK_M"), "ot"),
                 Store("lse", layout.rows("h", var("m_start"), "BLOCK_M", head_dim=False), "lt")]
        kernels = (Kernel("fwd", grid, tuple(_prune(body))),)
    else:
        notes.append("split partials: the source stores unnormalized acc with (m, l); the IR stores o_s = acc / l and "
                     "lse_s = m + log(l), which the combine merges identically")
        body += [Store("o_part", (var("b"), var("h"), var("s"), Span(var("m_start"), "BLOCK_M"), Full()), "ot"),
                 Store("lse_part", (var("b"), var("h"), var("s"), Span(var("m_start"), "BLOCK_M")), "lt")]
        part = Kernel("split", grid + (GridAxis("s", E("NUM_SPLITS")),), tuple(_prune(body)))
        comb = Kernel("combine", grid, (
            Let("m_start", E("m * BLOCK_M")),
            Load("po", "o_part", (var("b"), var("h"), Full(), Span(var("m_start"), "BLOCK_M"), Full())),
            Load("pl", "lse_part", (var("b"), var("h"), Full(), Span(var("m_start"), "BLOCK_M")), other=float("-inf")),
            Combine("ot", "lt", "po", "pl"),
            Store("o", (var("b"), var("h"), Span(var("m_start"), "BLOCK_M"), Full()), "ot"),
            Store("lse", (var("b"), var("h"), Span(var("m_start"), "BLOCK_M")), "lt"),
        ))
        kernels = (part, comb)
        params += [Param("o_part", ("B", "Hq", "NUM_SPLITS", "M", "D"), Dtype.F32, Role.SCRATCH),
                   Param("lse_part", ("B", "Hq", "NUM_SPLITS", "M"), Dtype.F32, Role.SCRATCH)]
    mask = conjunction(mask_terms)
    score = None
    if score_terms:
        score = var("score")
        for t in score_terms:
            score = Expr(ExprOp.ADD, (score, t))
    read = set().union(*(loaded_tensors(e) for k in kernels for e in _stmt_exprs_all(k.body)),
                       *(loaded_tensors(e) for e in (score, mask) if e is not None))
    params = [prm for prm in params if prm.role is not Role.AUX or prm.name in read]  # e.g. a split-count table
    return _Lifted(kernels, tuple(params), 1, score, mask, notes, spans)


def _stmt_exprs_all(body: tuple) -> list[Expr]:
    return [e for st in body for e in _stmt_exprs(st)]


def _decode_split_kernels(grid: tuple[GridAxis, ...], body: list, params: list[Param], layout: Layout
                          ) -> tuple[Kernel, Kernel]:
    """A decode split kernel storing each split's normalized rows and LSE (one head, or the heads of group `g`),
    and the kernel combining them per (b, h)."""
    o_row: tuple[Index, ...] = (var("b"), var("s"), Span(var("h"), 1))
    l_row = (var("b"), Full(), Span(var("h"), 1))
    split_grid = grid
    if layout.grouped:  # group g holds heads h0 = g * C ..: the grid covers Hq in steps of C
        assert layout.head0 is not None
        o_row = (var("b"), var("s"), layout.rows("h", var("h0"), "BLOCK_M", head_dim=False)[1])
        step = normal_form(substitute(layout.head0, {"g": const(1)}))
        split_grid = (grid[0], GridAxis("g", call("cdiv", var("Hq"), step)))
    part = Kernel("split", split_grid + (GridAxis("s", E("NUM_SPLITS")),), tuple(_prune(body + [
        Store("o_part", o_row + (Full(),), "ot"), Store("lse_part", o_row, "lt")])))
    comb = Kernel("combine", grid, (
        Load("po", "o_part", l_row + (Full(),)),
        Load("pl", "lse_part", l_row, other=float("-inf")),
        Combine("ot", "lt", "po", "pl"),
        Store("o", (var("b"), Span(var("h"), 1), Full()), "ot"),
        Store("lse", (var("b"), Span(var("h"), 1)), "lt"),
    ))
    params += [Param("o_part", ("B", "NUM_SPLITS", "Hq", "D"), Dtype.F32, Role.SCRATCH),
               Param("lse_part", ("B", "NUM_SPLITS", "Hq"), Dtype.F32, Role.SCRATCH)]
    return part, comb


def _stmt_exprs(st) -> list[Expr]:
    out: list[Expr] = []
    for f in ("value", "lo", "hi"):
        x = getattr(st, f, None)
        if isinstance(x, Expr):
            out.append(x)
    if isinstance(getattr(st, "at", None), TileAt):
        out += list(st.at)
    for ix in getattr(st, "index", ()) or ():
        if isinstance(ix, Span):
            out += [ix.start] + ([ix.until] if ix.until is not None else [])
        elif isinstance(ix, Gather):
            out += [ix.index] + ([ix.valid] if ix.valid is not None else [])
        elif not isinstance(ix, Full):
            out.append(ix)
    for sub in list(getattr(st, "body", ()) or ()) + list(getattr(st, "then", ()) or ()):
        out += _stmt_exprs(sub)
    return out


def _prune(body: list) -> list:
    """Drop `let`s nobody reads (the walk binds every kernel-scope scalar)."""
    while True:
        used: set[str] = set()
        for st in body:
            if not isinstance(st, Let):
                for e in _stmt_exprs(st):
                    used |= free_vars(e)
            else:
                used |= free_vars(st.value)
        dead = [st for st in body if isinstance(st, Let) and st.name not in used]
        if not dead:
            return body
        body = [st for st in body if st not in dead]


# ---------------------------------------------------------------- driver


def _walk(ctx: _Ctx, fn: JitFn, consts: dict[str, object], overrides: dict[str, Expr],
          values: dict[Expr, Expr] | None = None) -> KernelWalk:
    body = specialize(copy.deepcopy(fn.node.body), dict(consts), ctx.mod)
    return walk_kernel(ctx.mod, fn.node, body, dict(consts), overrides, values)


def _combine_kernel(ctx: _Ctx, split_fn: JitFn, split_walk: KernelWalk, flags: dict[str, bool]) -> JitFn | None:
    """The reduce kernel of a split-KV pair: reads what the split kernel stores, max/sum over splits
    (AMD: `tl.max`/`tl.sum` over a split axis), or a loop over the splits merging one (lse, o) at a time
    (vLLM, SGLang: `tl.maximum` of scalars); matched by parameter names, else the one such kernel in the file."""
    stored = {e.stored()[0] for e in split_walk.events if e.kind == "store"}
    named, merging = [], []
    for name, fn in ctx.mod.jit.items():
        if fn is split_fn or any(_is_matmul(n) for n in ast.walk(fn.node)):
            continue
        fixed, _ = flag_values(fn, ctx.mod)
        w = _walk(ctx, fn, {**fixed, **flags}, {})
        kinds = {e.kind for e in w.events}
        if {"colmax", "colsum"} <= kinds and ({"exp", "exp2"} & kinds) and stored <= {a.arg for a in fn.node.args.args}:
            named.append(fn)
        elif _merges_splits(fn):
            merging.append(fn)
    pick = named[0] if named else merging[0] if len(merging) == 1 else None
    if pick is not None:
        _snippet(ctx, "split_kv_combine", f"{pick.name}: LSE merge of split partials", "combine ot, lt = (po, pl)",
                 pick.node.lineno, pick.node.end_lineno or pick.node.lineno, features={"split_kv": True})
    return pick


def _merges_splits(fn: JitFn) -> bool:
    """A loop whose body loads partials, keeps a running max (`tl.maximum`) and rescales with exp, then a store."""
    def calls(node):
        return {ast.unparse(n.func).split(".")[-1] for n in ast.walk(node) if isinstance(n, ast.Call)}
    loops = [n for n in ast.walk(fn.node) if isinstance(n, ast.For)]
    return any({"load", "maximum"} <= calls(lp) and {"exp", "exp2"} & calls(lp) for lp in loops) \
        and "store" in calls(fn.node)


def _flag_snippets(ctx: _Ctx, fn: JitFn) -> None:
    for n in ast.walk(fn.node):
        if isinstance(n, ast.If):
            t = ast.unparse(n.test)
            if "DROPOUT" in t:
                _snippet(ctx, "dropout", f"{fn.name}: dropout ({t})", "where(keep, p, 0.0)", n.lineno,
                         n.end_lineno or n.lineno, node_file_of(n, ctx), {"dropout": True})
            elif "GQA" in t or "GROUP_SIZE" in t:
                _snippet(ctx, "gqa", f"{fn.name}: GQA head mapping", "h // (Hq // Hkv)", n.lineno,
                         n.end_lineno or n.lineno, node_file_of(n, ctx))
            elif "ALIBI" in t:
                _snippet(ctx, "alibi", f"{fn.name}: ALiBi ({t})", "score - slopes[b, h] * abs(q_idx + N - M - kv_idx)",
                         n.lineno, n.end_lineno or n.lineno, node_file_of(n, ctx), {"alibi": True})


def node_file_of(n: ast.AST, ctx: _Ctx) -> str:
    return getattr(n, "_kb_file", ctx.base.file)


def _lift_kernel(ctx: _Ctx, fn: JitFn) -> list[LiftedProgram]:
    fixed, enumerated = flag_values(fn, ctx.mod)
    tunables = _tunables(ctx, fn.name)
    schedule, sched_note = _default_schedule(ctx, fn.name, tunables)
    _flag_snippets(ctx, fn)
    out: list[LiftedProgram] = []
    skipped_before = len(ctx.skipped)
    combos = list(itertools.product((False, True), repeat=len(enumerated)))
    for tried, values in enumerate(combos):
        if _failing_alike(out, ctx.skipped[skipped_before:], tried):
            ctx.skipped.append((f"{fn.name}[{len(combos) - tried} more flag combinations]",
                                f"not tried: the first {tried} failed alike ({ctx.skipped[-1][1]})"))
            break
        flags = dict(zip(enumerated, values))
        label = ",".join(f"{k}={v}" for k, v in flags.items()) or "default"
        consts = {**fixed, **flags}
        try:
            first = _walk(ctx, fn, consts, {})
            dots = [e for e in first.events + [x for lp in first.loops for x in lp.events] if e.kind == "score_dot"]
            if not dots:
                raise _Skip("no tl.dot of a q tile with a k tile")
            q_base, k_base = dots[0].operands()
            roles = _roles(first, q_base, k_base)
            _kv_roles(first, k_base, roles)
            if var("g") in roles.overrides.values():  # grouped decode: the sizes the walk took for M
                sized = {p for p, role in first.params.items() if role == "dim:M"}
                named = _walk(ctx, fn, consts, {**roles.overrides, **{p: var(p) for p in sized}}, roles.values)
                roles.overrides.update(_grouped_sizes(named, k_base, sized))
            scale = {e.name() for e in _events(first, "scale_param")}
            if len(scale) == 1 and not _events(first, "scale"):
                roles.overrides[scale.pop()] = var("sm_scale")  # the scalar that multiplies the scores
            overrides, found = roles.overrides, roles.found
            pids = {f"pid{i}" for i in range(3)} - set(found.values())
            split_axis = None
            loop_names: set[str] = set()
            for lp in first.loops:
                loop_names |= free_vars(lp.lo) | free_vars(lp.hi)
            lets = {it[1]: it[2] for it in first.lets if it[0] == "let"}
            for name in list(loop_names):
                if name in lets:
                    loop_names |= free_vars(lets[name])
            for pid in sorted(pids):
                if pid in loop_names:
                    overrides[pid], split_axis = var("s"), pid
            walk = _walk(ctx, fn, consts, overrides, roles.values)
            if walk.unknown:
                raise _Skip("constructs not understood: " + "; ".join(f"line {ln}: {w}" for ln, w in walk.unknown[:6]))
            hk = _kv_head(walk, k_base)
            layout = _layout(walk, q_base, k_base)
            combine_fn = None
            if split_axis is not None:
                combine_fn = _combine_kernel(ctx, fn, walk, flags)
                if combine_fn is None:
                    raise _Skip("split-KV kernel without a recognizable combine kernel")
            lifted = _assemble(ctx, walk, hk, split_axis, layout, _launched_in_log2(ctx, fn, walk, overrides))
        except _Skip as why:
            ctx.skipped.append((f"{fn.name}[{label}]", str(why)))
            continue
        sched = schedule
        if split_axis is not None:
            sched = replace(sched, num_splits=3)
        name = f"{ctx.family}_{fn.name.strip('_')}" + "".join(f"_{k.lower()}" for k, v in flags.items() if v)
        prog = Program(name, lifted.params, sched, lifted.kernels,
                       score_mod=VariantFn("score_mod", SCORE_MOD_PARAMS, lifted.score_mod) if lifted.score_mod else None,
                       mask_mod=VariantFn("mask_mod", MASK_MOD_PARAMS, lifted.mask_mod) if lifted.mask_mod else None)
        notes = [sched_note, *lifted.notes]
        try:
            validate(prog)
        except KBError as err:
            ctx.skipped.append((f"{fn.name}[{label}]", f"lifted program fails validation: {err}"))
            _spans_to_snippets(ctx, lifted, flags)
            continue
        gqa = "Hkv" in free_vars(resolved_let(prog.kernels[0].body, "hk"))
        if layout.decode:
            ok, note = verify_decode(prog, gqa=gqa)
        elif layout.packed:
            ok, note = verify_packed(prog, gqa=gqa)
        else:
            ok, note = verify_program(prog, split=split_axis is not None, gqa=gqa)
        _spans_to_snippets(ctx, lifted, flags)
        if not ok:
            ctx.skipped.append((f"{fn.name}[{label}]", f"interpreter check failed: {note}"))
            continue
        feats = _features(prog, flags, split_axis is not None, layout)
        prov = _prov(ctx, fn.node.lineno, fn.node.end_lineno or fn.node.lineno)
        out.append(LiftedProgram(name, ctx.family, prog, prov, tuple(tunables), ok, note, feats,
                                 tuple(flags.items()), tuple(notes)))
    ctx.skipped[skipped_before:] = merge_skips(fn.name, ctx.skipped[skipped_before:])
    return out


ALIKE_FAILURES = 4  # flag combinations that fail for one reason before the rest are not tried


def _failing_alike(lifted: list, skips: list[tuple[str, str]], tried: int) -> bool:
    """Nothing lifted and every combination tried so far failed for the same reason (the flags do not reach it)."""
    return tried >= ALIKE_FAILURES and not lifted and len(skips) == tried and len({why for _, why in skips}) == 1


def _without_length(p: Program, layout: Layout) -> Program:
    """`p` with the packed sequence's own key bound (`kv_idx < length[b]`) out of mask_mod: that is
    the ragged-KV bound a dense program has built in, not a variant mask (for classification only)."""
    if layout.length is None or p.mask_mod is None:
        return p
    bound = normal_compare(ExprOp.LT, var("kv_idx"), layout.length)
    rest = [c for c in conjuncts(p.mask_mod.body) if c != bound]
    body = conjunction(rest)
    return replace(p, mask_mod=replace(p.mask_mod, body=body) if body is not None else None)


def _features(p: Program, flags: dict[str, bool], split: bool, layout: Layout = DENSE) -> Features:
    f = replace(derive_features(_without_length(p, layout)), varlen=derive_features(p).varlen)
    f = replace(f, split_kv=split or f.split_kv, return_lse=True)
    if any(v and "ALIBI" in k for k, v in flags.items()):
        f = replace(f, alibi=True, score_mod="alibi" if f.score_mod == "none" else f.score_mod)
    return f


def _spans_to_snippets(ctx: _Ctx, lifted: _Lifted, flags: dict[str, bool]) -> None:
    feats = {"causal": True} if any(v and "CAUSAL" in k for k, v in flags.items()) else {}
    for kind, ir, start, end, file in lifted.spans:
        if kind == "score_mod":
            continue  # the score dot itself is not a snippet
        _snippet(ctx, kind, f"{kind.replace('_', ' ')} ({Path(file or ctx.base.file).name}:{start})", ir, start, end,
                 file, feats if kind == "mask_causal" else {})


def _is_matmul(n: ast.AST) -> bool:
    """`tl.dot(a, b)`, or a reduced product `tl.sum(a[None, :] * b, 1)` (the dot of a 1-row tile)."""
    if not isinstance(n, ast.Call):
        return False
    name = ast.unparse(n.func)
    if name.endswith("dot"):
        return True
    arg = n.args[0] if name.endswith("sum") and n.args else None
    while isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "to":
        arg = arg.func.value  # `(q[None, :] * k).to(tl.float32)`
    return isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Mult)


def lift_module(mod: TritonModule, provenance_base: Provenance, family: str) -> LiftReport:
    ctx = _Ctx(mod, provenance_base, family)
    if not mod.jit:
        return LiftReport(provenance_base.file, skipped=(("file", "no @triton.jit kernel in the file"),))
    bwd = lift_backward(mod, provenance_base, family)
    ctx.backward = bwd.handled
    programs: list[LiftedProgram] = list(bwd.programs)
    tunables: list[LiftedTunable] = list(bwd.tunables)
    ctx.snippets += bwd.snippets
    ctx.skipped += bwd.skipped
    called = {n.func.id for f in mod.jit.values() for n in ast.walk(f.node)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    for fn in mod.jit.values():
        if fn.name in bwd.handled:
            continue
        for r in serving_regions(fn.node):
            _snippet(ctx, r.kind, r.title, r.ir_text, r.start, r.end, features=dict(r.features))
        if fn.name in called:
            continue  # helpers are inlined into the kernels that call them
        reach = [fn.node] + [g.node for g in (*mod.jit.values(), *mod.imported_jit.values()) if g.name in called]
        if not any(_is_matmul(n) for r in reach for n in ast.walk(r)):
            continue  # no matmul anywhere: a reduce kernel, reached from its split kernel
        try:
            progs = _lift_kernel(ctx, fn)
        except (RecursionError, KBError, KeyError, ValueError, TypeError, IndexError) as err:
            ctx.skipped.append((fn.name, f"lifter error: {type(err).__name__}: {err}"))
            continue
        programs += progs
        tunables += _tunables(ctx, fn.name)
    return LiftReport(provenance_base.file, programs=tuple(programs), snippets=tuple(ctx.snippets),
                      tunables=tuple(tunables), skipped=tuple(ctx.skipped), backward=tuple(bwd.coverage))


def lift_file(path: Path, provenance_base: Provenance, family: str = "triton") -> LiftReport:
    """Lift every forward attention kernel in `path`; malformed files are reported as skipped, never raised."""
    try:
        mod = parse_module(Path(path), provenance_base.file)
    except SyntaxError as err:
        return LiftReport(provenance_base.file, skipped=(("file", f"syntax error at line {err.lineno}: {err.msg}"),))
    except (OSError, UnicodeError) as err:
        return LiftReport(provenance_base.file, skipped=(("file", f"cannot read: {err}"),))
    return lift_module(mod, provenance_base, family)
