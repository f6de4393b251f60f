"""CuTe DSL lifter (Python `ast`): FA4 and CUTLASS CuTe DSL attention sources -> snippets and tunables.

Regions are functions, classes, if-branches (with `const_expr(...)`/`cutlass.const_expr(...)`
unwrapped) and assignments; a rule table (same shape as ingest.cuda_rules) maps them to snippet
kinds with IR meanings. Tunables come from two places: functions that return a config dataclass
built from literal tile sizes (FA4's `_tile_size_fwd_sm90` returns `FwdConfig(tile_m, tile_n,
...)` under head-dim conditions), and `__init__` defaults of kernel classes (tile_m/tile_n,
m_block_size/n_block_size, num_stages, num_threads).

`lift_file` never raises on bad input: unreadable files and syntax errors land in `skipped`.
"""

from __future__ import annotations

import ast
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ingest.cuda_rules import CAUSAL_BR, CAUSAL_TL, LOCAL_BR, BOUNDS, NMAX_BR, ONLINE, FINALIZE, COMBINE, PAGED, SOFTCAP, VARLEN, GQA
from ingest.model import FetchedSource, LiftedSnippet, LiftedTunable, LiftReport, Provenance

__all__ = ["lift_file", "LIFTER", "LIFTER_VERSION"]

log = logging.getLogger(__name__)
LIFTER = "cute"
LIFTER_VERSION = "1"
FAMILY_ARCH = {"cutlass_cute_sm80": "sm80"}

MASK_MOD = "mask s at (b, h, m_start, n_start) mask_mod"
SCORE_MOD = "score_mod s at (b, h, m_start, n_start)"
BLOCK_SPARSE = "if block(b, h, m_start, n_start) is full:"


@dataclass(frozen=True)
class PyRegion:
    kind: str  # "function", "class", "if", "else", "assign"
    head: str
    scope: str
    line_start: int
    line_end: int


@dataclass(frozen=True)
class PyRule:
    kinds: tuple[str, ...]
    head: str
    snippet_kind: str
    title: str
    ir: str
    features: dict
    scope: str | None = None
    once_per_scope: bool = False
    once_per_file: bool = False  # for statement-level rules that would repeat in every method


def _p(kinds: str, head: str, kind: str, title: str, ir: str, features: dict | None = None, **kw) -> PyRule:
    return PyRule(tuple(kinds.split(",")), head, kind, title, ir, features or {}, **kw)


RULES: tuple[PyRule, ...] = (
    # FA4 mask.py
    _p("if", r"^not mask_causal and \(?not mask_local\)? and \(?mask_mod is None\)?$", "mask_bounds",
       "Seqlen-only mask: columns past seqlen_k -> -inf", BOUNDS, scope=r"apply_mask"),
    _p("if", r"^not mask_causal and \(?not mask_local\)? and \(?mask_mod is not None\)?$", "mask_mod",
       "FlexAttention-style mask_mod evaluated per (b, h, q_idx, kv_idx) on the score tile", MASK_MOD, {"mask": "custom"},
       scope=r"apply_mask"),
    _p("if", r"^mask_causal$", "mask_causal", "Causal mask, bottom-right aligned (col limit = row + 1 + seqlen_k - seqlen_q)",
       CAUSAL_BR, {"causal": True}, scope=r"apply_mask", once_per_scope=True),
    _p("else", r"^not \(mask_causal\)$", "mask_local", "Local (sliding-window) mask: left and right column limits",
       LOCAL_BR, {"sliding_window": True}, scope=r"apply_mask", once_per_scope=True),
    _p("function", r"^call_mask_mod$", "mask_mod", "Call a user mask_mod on index tensors", MASK_MOD, {"mask": "custom"}),
    _p("function", r"^get_trip_count$", "kv_loop_bounds", "Fused mask trip count (causal/local block skipping)", NMAX_BR,
       {"causal": True}, scope=r"Sm100FusedMask"),
    _p("class", r"^AttentionMask$", "mask_causal", "AttentionMask: seqlen, causal, local and mask_mod masking of S",
       CAUSAL_BR, {"causal": True, "sliding_window": True}),
    # FA4 softmax.py
    _p("function", r"^call_score_mod$", "score_mod", "Call a user score_mod on the score tile", SCORE_MOD, {"score_mod": "custom"}),
    _p("function", r"^online_softmax$", "online_softmax", "Online softmax: row max, exp2, row sum, rescale factor", ONLINE),
    _p("function", r"^rescale_O$", "softmax_rescale", "Rescale O accumulator by exp2(m_old - m_new)", ONLINE),
    _p("function", r"^finalize$", "softmax_finalize", "Finalize: 1/row_sum and LSE", FINALIZE, {"return_lse": True},
       scope=r"Softmax"),
    _p("function", r"^apply_learnable_sink$", "softmax_finalize", "Learnable attention sink folded into the row sum", FINALIZE),
    # softcap anywhere
    _p("if,assign", r"softcap", "softcap", "Logit softcap on the score tile", SOFTCAP, {"softcap": True, "score_mod": "softcap"},
       once_per_file=True),
    # FA4 block sparsity
    _p("function", r"^(produce|consume)_block_sparse_loads$", "block_sparse",
       "Block-sparse KV iteration: full blocks without mask, partial blocks with mask_mod", BLOCK_SPARSE,
       {"mask": "block_sparse"}),
    _p("function", r"^get_curr_blocksparse_tensors$", "block_sparse",
       "Per (batch, head, m_block) counts and indices of full / partial KV blocks",
       "let n_blocks = mask_block_cnt[b, h, m] + full_block_cnt[b, h, m]", {"mask": "block_sparse"}),
    _p("class", r"^BlockSparseTensors$", "block_sparse", "Block-sparse metadata: mask/full block counts and indices",
       "let n_blocks = mask_block_cnt[b, h, m] + full_block_cnt[b, h, m]", {"mask": "block_sparse"}),
    _p("function", r"^normalize_block_sparse_config$", "block_sparse", "Validate and broadcast block-sparse metadata",
       "let n_blocks = mask_block_cnt[b, h, m] + full_block_cnt[b, h, m]", {"mask": "block_sparse"}),
    # FA4 paged KV, combine, GQA, varlen
    _p("class", r"^PagedKVManager$", "paged_kv", "Paged KV: page table lookup and per-page TMA/cp.async loads", PAGED,
       {"paged_kv": True}),
    _p("function", r"^load_page_table$", "paged_kv", "Load the page indices of one KV block", PAGED, {"paged_kv": True}),
    _p("class", r"^FlashAttentionForwardCombine$", "split_kv_combine", "Split-KV combine kernel: LSE-weighted sum of partials",
       COMBINE, {"split_kv": True}),
    _p("if,assign", r"qhead_per_kvhead", "gqa", "GQA: query heads per KV head (pack_gqa folds them into M)", GQA, {},
       once_per_file=True),
    _p("if,assign", r"cu_seqlens_q|SeqlenInfo", "varlen", "Varlen: per-batch offsets and lengths from cu_seqlens", VARLEN,
       {"varlen": True}, once_per_file=True),
    _p("class", r"^FlashAttentionForward(Sm90|Sm100|Base|Ampere)$", "schedule", "Forward kernel class and its schedule",
       "schedule block_m=tile_m block_n=tile_n num_stages=num_stages num_threads=num_threads"),
    # CUTLASS flash_attention_v2.py (Ampere example)
    _p("if", r"^self\._is_causal$", "kv_loop_bounds", "Causal: stop the KV loop at the diagonal block",
       "minimum(cdiv(N, BLOCK_N), cdiv((m + 1) * BLOCK_M, BLOCK_N))", {"causal": True}, scope=r"kernel$", once_per_scope=True),
    _p("else", r"^not \(not self\._is_causal\)$", "mask_causal", "Causal mask of the diagonal tiles (col > row -> -inf)",
       CAUSAL_TL, {"causal": True}),
    _p("function", r"^num_splits_heuristic$", "split_kv_heuristic",
       "num_splits: smallest split count reaching 85% of the best wave efficiency",
       "let num_splits = smallest s with eff(s) >= 0.85 * max eff, eff(s) = waves(s) / ceil(waves(s))",
       {"split_kv": True, "decode": True}),
    _p("function", r"^softmax_rescale_O$", "softmax_rescale", "Online softmax: rescale O and row sums per KV tile", ONLINE),
    _p("function", r"^compute_one_n_block$", "online_softmax", "One KV tile: S = Q K^T, mask, online softmax, O += P V", ONLINE),
)


def _unwrap(test: ast.expr) -> ast.expr:
    while isinstance(test, ast.Call) and ast.unparse(test.func) in ("const_expr", "cutlass.const_expr") and len(test.args) == 1:
        test = test.args[0]
    return test


def _regions(tree: ast.AST) -> Iterator[PyRegion]:
    def visit(node: ast.AST, scope: tuple[str, ...]) -> Iterator[PyRegion]:
        for child in ast.iter_child_nodes(node):
            s = "::".join(scope)
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                yield PyRegion("class" if isinstance(child, ast.ClassDef) else "function", child.name, s, start, child.end_lineno or start)
                inner = scope + (child.name,)
            elif isinstance(child, ast.If):
                test = ast.unparse(_unwrap(child.test))
                end_then = max(n.end_lineno or child.lineno for n in child.body)
                yield PyRegion("if", test, s, child.lineno, end_then)
                if child.orelse:
                    yield PyRegion("else", f"not ({test})", s, child.orelse[0].lineno, child.end_lineno or child.lineno)
            elif isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                yield PyRegion("assign", ast.unparse(child), s, child.lineno, child.end_lineno or child.lineno)
            yield from visit(child, inner)
    yield from visit(tree, ())


def _conditions(fn: ast.FunctionDef, target: ast.AST) -> list[str] | None:
    """Enclosing if-conditions of `target` inside `fn` (negated in else branches)."""
    def search(stmts: list[ast.stmt], acc: list[str]) -> list[str] | None:
        for st in stmts:
            if st is target:
                return acc
            if isinstance(st, ast.If):
                test = ast.unparse(_unwrap(st.test))
                found = search(st.body, acc + [test])
                if found is None:
                    found = search(st.orelse, acc + [f"not ({test})"])
                if found is not None:
                    return found
            elif isinstance(st, (ast.For, ast.While, ast.With, ast.Try)):
                found = search(getattr(st, "body", []), acc)
                if found is not None:
                    return found
        return None
    return search(fn.body, [])


_FIELD_NAMES = {"m_block_size": "block_m", "n_block_size": "block_n", "tile_m": "block_m", "tile_n": "block_n"}


def _head_dim(conds: list[str]) -> int:
    bounds = [int(m.group(1)) for c in conds if not c.startswith("not") and (m := re.search(r"head_dim <= (\d+)", c))]
    return min(bounds) if bounds else 0


def _config_tunables(tree: ast.Module, family: str, prov) -> list[LiftedTunable]:
    fields_of: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
            fields_of[node.name] = [st.target.id for st in node.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)]
    out: list[LiftedTunable] = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        if not re.search(r"tile_size_fwd|fwd_config", fn.name):
            continue
        arch_m = re.search(r"sm(\d+)", fn.name)
        assigns = sorted((st.lineno, t.id, ast.unparse(st.value)) for st in ast.walk(fn) if isinstance(st, ast.Assign)
                         for t in st.targets if isinstance(t, ast.Name))
        for ret in (n for n in ast.walk(fn) if isinstance(n, ast.Return)):
            call = ret.value
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in fields_of):
                continue
            args = [a for a in call.args if isinstance(a, (ast.Constant, ast.Name))]
            if len(args) != len(call.args):
                continue
            conds = _conditions(fn, ret) or []
            params: dict[str, object] = {}
            for name, a in zip(fields_of[call.func.id], args):
                # The nearest assignment above the return (branches assign the same name differently).
                prior = [v for line, n, v in assigns if n == a.id and line < ret.lineno] if isinstance(a, ast.Name) else []
                value = a.value if isinstance(a, ast.Constant) else (prior[-1] if prior else a.id)
                params[_FIELD_NAMES.get(name, name)] = value
            out.append(LiftedTunable(family, f"sm{arch_m.group(1)}" if arch_m else FAMILY_ARCH.get(family, "any"),
                                     _head_dim(conds), "any", params,
                                     " and ".join(f"({c})" if " or " in c and not c.startswith("not") else c for c in conds),
                                     prov(ret.lineno, ret.end_lineno or ret.lineno)))
    return out


_DEFAULTS = {"tile_m": "block_m", "tile_n": "block_n", "m_block_size": "block_m", "n_block_size": "block_n",
             "num_stages": "num_stages", "num_threads": "num_threads"}


def _init_default_tunables(tree: ast.Module, family: str, prov) -> list[LiftedTunable]:
    out: list[LiftedTunable] = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:
            continue
        args = init.args.args[len(init.args.args) - len(init.args.defaults):]
        params: dict[str, object] = {_DEFAULTS[a.arg]: d.value for a, d in zip(args, init.args.defaults)
                                     if a.arg in _DEFAULTS and isinstance(d, ast.Constant)}
        if "block_m" in params or "block_n" in params:
            arch = re.search(r"Sm(\d+)", cls.name)
            out.append(LiftedTunable(family, f"sm{arch.group(1)}" if arch else FAMILY_ARCH.get(family, "any"), 0, "any",
                                     params, f"defaults of {cls.name}.__init__", prov(init.lineno, init.end_lineno or init.lineno)))
    return out


def lift_file(path: Path, source: FetchedSource | None = None, family: str = "fa4_cute") -> LiftReport:
    path = Path(path)
    rel = path.name
    if source is not None:
        try:
            rel = path.resolve().relative_to(source.root.resolve()).as_posix()
        except ValueError:
            pass
    dist, version = (source.distribution, source.version) if source else ("local", "0")
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as err:
        return LiftReport(rel, skipped=((rel, f"cannot parse as Python: {err}"),))
    lines = text.split("\n")

    def prov(a: int, b: int) -> Provenance:
        return Provenance(dist, version, rel, a, b, LIFTER, LIFTER_VERSION)

    arch = FAMILY_ARCH.get(family)
    snippets: list[LiftedSnippet] = []
    seen: set[tuple[int, str]] = set()
    for region in _regions(tree):
        for i, rule in enumerate(RULES):
            if region.kind in rule.kinds and re.search(rule.head, region.head) and (rule.scope is None or re.search(rule.scope, region.scope)):
                key = (i, "" if rule.once_per_file else region.scope)
                if (rule.once_per_scope or rule.once_per_file) and key in seen:
                    break
                seen.add(key)
                feats = {**rule.features, **({"arch": arch} if arch else {})}
                head = region.head if len(region.head) <= 60 else region.head[:57] + "..."
                title = f"{rule.title} [{region.scope + '::' if region.scope else ''}{region.kind} {head}]"
                snippets.append(LiftedSnippet(rule.snippet_kind, title, rule.ir,
                                              "\n".join(lines[region.line_start - 1 : region.line_end]), feats,
                                              prov(region.line_start, region.line_end)))
                break
    tunables = _config_tunables(tree, family, prov) + _init_default_tunables(tree, family, prov)
    skipped = () if snippets or tunables else ((rel, "no known CuTe DSL region (mask, softmax, block sparsity, schedule) found"),)
    log.info("lifted %s: %d snippets, %d tunables", rel, len(snippets), len(tunables))
    return LiftReport(rel, (), tuple(snippets), tuple(tunables), skipped)
