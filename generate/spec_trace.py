"""Trace an attention computation with torch.fx and read off its variant expressions.

`trace_attention(fn, inputs, ...)` records the forward's pre-dispatch aten ops on real tensors
(`generate.spec_fx`, the graph torch's make_fx gives) and interprets the graph abstractly:
- q, k, v are `Operand`s: the placeholders that reach `matmul`/`einsum`/SDPA through
  layout ops only; transposes, head repetition (GQA: `repeat_interleave`, or
  unsqueeze+expand+reshape) and scalar scaling are tracked on them;
- everything on the score side is a `Sym` (spec_sym), with the QK^T product as the free
  name `score`; buffers, parameters and extra inputs become loads of named aux tensors;
- at softmax the [B, H, M, N] logits are named (b, h, q_idx, kv_idx) and split into a
  score part and a mask (-inf fills, where/masked_fill, additive -inf masks);
- after softmax only eval-mode dropout, dtype casts and the product with V are allowed;
- serving layouts (generate.spec_serving): a KV input gathered as `cache[table]` by an integer input
  is a paged cache / token pool (its (page, slot) dims flatten into the key axis); a 3-D input is q
  [B, H, D] with `unsqueeze(2)` or packed tokens [T, H, D] with `transpose(0, 1).unsqueeze(0)`;
  such a spec may reshape the attention output into its own layout.

`trace_mod(fn, params, ...)` traces a FlexAttention-style score_mod/mask_mod the same way.
Unsupported constructs raise `KBError` naming the aten op and the spec source line. The ops read on the
score/mask side are a registry, `SCORE_OPS` (aten op -> handler, added with `@_score_op(...)`); an op
missing there is refused with the list of those supported; `supported_ops()` lists every op tracing
reads, for docs/specs.md.
"""

from __future__ import annotations

import keyword
import logging
import math
import operator
import re
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from generate import spec_sym as S
from generate.spec_fx import record_graph
from generate.spec_sym import Sym
from kb.errors import KBError
from kb.ir.algebra import all_of, simplify
from kb.ir.classify import fit_band
from kb.ir.expr import Expr, ExprOp, call, const, free_vars, load, number, substitute, var, walk
from kb.ir.nodes import SCHEDULE_CONSTANTS
from kb.lower.triton_host import host_name_clash
from verify.flex_mods import TensorIndexing

__all__ = ["Operand", "TracedAttention", "trace_attention", "trace_mod", "NameOf", "aux_name", "tensor_namer",
           "SCORE_OPS", "supported_ops"]

log = logging.getLogger(__name__)

NameOf = Callable[[torch.Tensor], str | None]


@dataclass(frozen=True)
class Operand:
    """q, k or v on its way to a matmul. `labels` name each dim: b, h, s, d, '1' (inserted
    size-1 dim) or 'g' (head-group dim being expanded); `rep` = head repetition (GQA);
    `factor` = a run-time scalar it is multiplied by (`q * self.temperature`), None if none."""

    name: str
    labels: tuple[str, ...]
    shape: tuple[int, ...]
    scale: float = 1.0
    rep: int = 1
    factor: Expr | None = None


@dataclass(frozen=True)
class _Probs:
    """softmax of the scores; `sink`: the number of key columns while an attention sink's column follows them."""

    sink: int | None = None


@dataclass(frozen=True)
class _Output:
    pass


@dataclass(frozen=True)
class TracedAttention:
    """What a traced spec computes: softmax(score_mod(scale * q k^T) masked by mask_mod) @ v."""

    score_mod: Expr | None
    mask_mod: Expr | None
    scale: float
    q: str  # input names
    k: str
    v: str
    gqa_ratio: int
    aux: Mapping[str, torch.Tensor]
    dropout: bool = False
    out_dtype: torch.dtype = torch.float32  # the dtype the traced forward returns
    # aux tensors that are entries of the Model's state_dict (parameters, persistent buffers):
    # aux name -> state_dict key. The kernel reads them at run time, so a new value takes effect.
    state: Mapping[str, str] = field(default_factory=dict)
    # state_dict keys of buffers replaced by the index expression their values equal (a tril mask)
    baked: frozenset[str] = frozenset()
    # aux tensors computed from a forward input before the launch: name -> (input name, searchsorted right?)
    derived: Mapping[str, tuple[str, bool]] = field(default_factory=dict)
    # serving layouts (docs/specs.md): KV inputs gathered as `cache[table]` -> the table's input name, and
    # inputs read as packed tokens [T, H, D] (`x.transpose(0, 1).unsqueeze(0)`)
    gathers: Mapping[str, str] = field(default_factory=dict)
    packed: frozenset[str] = frozenset()
    # an attention sink: the logit (in b, h) of a column the softmax saw beside the keys, which carries no value
    sink: Expr | None = None
    # chunked prefill: the cache gathered per packed query token by the token's sequence; (ids, offsets) of
    # `ids = searchsorted(offsets, arange(T), right=True)`, the expressions written per (sequence b, query q_idx)
    token_seq: tuple[str, str] | None = None


@dataclass
class _State:
    names: dict[torch.fx.Node, str]
    name_of: NameOf
    source: str | None
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    state_kinds: Mapping[str, str] = field(default_factory=dict)  # state_dict key -> "parameter" | "buffer"
    state: dict[str, str] = field(default_factory=dict)  # aux name -> state_dict key
    baked: set[str] = field(default_factory=set)
    derived: dict[str, tuple[str, bool]] = field(default_factory=dict)
    gathers: dict[str, str] = field(default_factory=dict)  # cache input -> table input (cache[table])
    packed: set[str] = field(default_factory=set)  # inputs read as packed tokens [T, H, D]
    q: Operand | None = None
    k: Operand | None = None
    v: Operand | None = None
    logits: Sym | None = None
    softmax_node: torch.fx.Node | None = None
    n_const: int = 0
    score_dims: tuple[str, ...] = ("b", "h", "q_idx", "kv_idx")  # the names of the score tensor's dims (SCORE_LAYOUTS)
    sink_cat: int | None = None  # keys before the sink column that torch.cat appended to the scores
    sink: Expr | None = None  # the sink logit, named (b, h)
    token_seq: tuple[str, str] | None = None  # per-token gathered KV: (ids, offsets) of `ids[t] - 1`, the token's sequence


def _where(node: torch.fx.Node, source: str | None) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', trace)
    frames = [f for f in frames if f[0] != __file__]  # the tracer's own call of the spec or mod
    if source:
        mine = [f for f in frames if f[0] == source]
        frames = mine or frames
    if not frames:
        return "at an unknown line"
    f, line, code = frames[-1]
    return f"at {f}:{line}: {code.strip()}"


def _err(node: torch.fx.Node, st: _State, msg: str,
         hint: str = "see docs/specs.md for the supported attention patterns") -> KBError:
    return KBError(f"{msg} (aten op {_op_name(node)}, {_where(node, st.source)})", hint=hint)


def _op_name(node: torch.fx.Node) -> str:
    t = node.target
    return getattr(t, "__name__", str(t)) if not hasattr(t, "_overloadpacket") else str(t).replace("aten.", "")


def _packet(node: torch.fx.Node) -> str:
    t = node.target
    if hasattr(t, "_overloadpacket"):
        return t._overloadpacket.__name__
    return getattr(t, "__name__", str(t))


# ---------------------------------------------------------------- leaves


def _const_leaf(t: torch.Tensor, name: str) -> Sym:
    if t.numel() == 1:
        v = t.item()
        return Sym(tuple(t.shape), const(bool(v) if t.dtype == torch.bool else v), t.dtype)
    pattern = _pattern_leaf(t)
    if pattern is not None:
        return pattern
    return S.load_leaf(name, t)


def _pattern_leaf(t: torch.Tensor) -> Sym | None:
    """A mask buffer whose values are exactly a diagonal band (tril, sliding window, prefix)
    becomes that index expression instead of a load."""
    if t.dim() < 2 or any(n != 1 for n in t.shape[:-2]):
        return None
    m = t.reshape(t.shape[-2], t.shape[-1])
    if t.dtype == torch.bool:
        attend, on, off = m, const(True), const(False)
    else:
        vals = torch.unique(m.float())
        if set(vals.tolist()) <= {0.0, 1.0}:
            attend = m != 0
            on, off = (const(1.0), const(0.0)) if t.dtype.is_floating_point else (const(1), const(0))
        elif len(vals) == 2 and vals[0].item() <= S.NEG_INF_THRESHOLD and vals[1].item() == 0.0:
            attend, on, off = m == 0, const(0.0), const(vals[0].item())
        else:
            return None
    band = fit_band(attend)
    if band is None:
        return None
    i, j = S.dvar(t.dim() - 2), S.dvar(t.dim() - 1)
    cond = _band_expr(i, j, band.lo, band.hi, band.prefix)
    e = cond if t.dtype == torch.bool else call("where", cond, on, off)
    return Sym(tuple(t.shape), e, t.dtype)


def _band_expr(i: Expr, j: Expr, lo: int | None, hi: int | None, prefix: int | None) -> Expr:
    parts: list[Expr] = []
    if hi is not None:
        parts.append(j <= (i if hi == 0 else i + hi))
    if lo is not None:
        parts.append(i - j < 1 - lo)
    cond = all_of(parts) if parts else const(True)
    if prefix:
        cond = (j < prefix) | cond
    return cond


# ---------------------------------------------------------------- value coercion


def _sym(x: Any, node: torch.fx.Node, st: _State) -> Sym:
    if isinstance(x, Sym):
        return x
    if isinstance(x, (bool, int, float)):
        return S.scalar_sym(x)
    if isinstance(x, Operand):
        raise _err(node, st, f"{x.name} (an attention input) is used in score arithmetic")
    if isinstance(x, (_Probs, _Output)):
        raise _err(node, st, "unsupported use of the attention probabilities/output")
    raise _err(node, st, f"unsupported argument {type(x).__name__}")


def _scalar(x: Any) -> float | None:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, Sym) and x.expr.op is ExprOp.CONST and not x.is_bool and math.prod(x.shape) == 1:
        return float(number(x.expr))
    return None


def _dtype_of(node: torch.fx.Node) -> torch.dtype:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


# ---------------------------------------------------------------- operand (q/k/v) ops


_LAYOUT = {"transpose", "permute", "t", "mT", "view", "reshape", "_unsafe_view", "unsqueeze", "expand", "clone",
           "contiguous", "repeat_interleave", "_to_copy", "to", "type_as", "alias", "detach", "mul", "div", "repeat",
           "squeeze", "flatten"}
_GATHERS = {"index_select", "gather", "take", "embedding", "take_along_dim"}
# ops a serving spec may apply to the attention output to return its own layout ([B, Hq, D], [T, Hq, D])
_OUTPUT_LAYOUT = {"squeeze", "unsqueeze", "transpose", "permute", "t", "view", "reshape", "_unsafe_view", "flatten",
                  "select"}


def _operand_op(pk: str, node: torch.fx.Node, x: Operand, args: list[Any], st: _State) -> Operand:
    out_shape = tuple(node.meta["val"].shape)
    if pk in ("clone", "contiguous", "_to_copy", "to", "type_as", "alias", "detach"):
        return x
    if pk in ("transpose", "t", "mT", "permute"):
        n = len(x.labels)
        if pk == "t":
            perm = [1, 0]
        elif pk in ("transpose", "mT"):
            a, b = (args[1] % n, args[2] % n) if pk == "transpose" else (n - 2, n - 1)
            perm = list(range(n))
            perm[a], perm[b] = perm[b], perm[a]
        else:
            perm = [p % n for p in args[1]]
        return replace(x, labels=tuple(x.labels[p] for p in perm), shape=out_shape)
    if pk == "unsqueeze":
        d = args[1] % (len(x.labels) + 1)
        return replace(x, labels=x.labels[:d] + ("1",) + x.labels[d:], shape=out_shape)
    if pk == "squeeze":
        keep = [i for i, n in enumerate(out_shape)]
        labels = tuple(lab for lab, n in zip(x.labels, x.shape) if not (n == 1 and lab == "1"))
        if len(labels) != len(keep):
            raise _err(node, st, f"squeeze of {x.name}")
        return replace(x, labels=labels, shape=out_shape)
    if pk == "expand":
        labels = tuple("g" if (lab == "1" and n != 1) else lab for lab, n in zip(x.labels, out_shape[-len(x.labels):]))
        if len(out_shape) != len(x.labels):
            raise _err(node, st, f"expand adds dims to {x.name}")
        return replace(x, labels=labels, shape=out_shape)
    if pk in ("view", "reshape", "_unsafe_view", "flatten"):
        return _operand_view(node, x, out_shape, st)
    if pk == "index":
        return _gather(node, x, args[1], out_shape, st)
    if pk in _GATHERS:
        raise _err(node, st, f"gathering {x.name} with {pk}: read a paged cache as {x.name}[block_table] "
                             "(one index by the [B, MAX_PAGES] table, then flatten(1, 2))")
    if pk == "repeat_interleave":
        reps, dim = args[1], (args[2] if len(args) > 2 else node.kwargs.get("dim"))
        if not isinstance(reps, int) or not isinstance(dim, int) or x.labels[dim % len(x.labels)] != "h":
            raise _err(node, st, f"repeat_interleave of {x.name} other than over the head dim by a constant")
        return replace(x, rep=x.rep * reps, shape=out_shape)
    if pk == "repeat":
        if any(r != 1 for r, lab in zip(args[1][-len(x.labels):], x.labels) if lab == "h"):
            raise _err(node, st, f"{x.name}.repeat() tiles heads (head j reads kv head j % Hkv); GQA maps head j to "
                                 "j // (Hq // Hkv): use repeat_interleave(dim=1)")
        if any(r != 1 for r in args[1]):
            raise _err(node, st, f"repeat of {x.name}")
        return x
    if pk in ("mul", "div"):
        other = args[1] if args[0] is x else args[0]
        if pk == "div" and args[0] is not x:
            raise _err(node, st, f"{x.name} is a divisor")
        c = _scalar(other)
        if c is not None:
            return replace(x, scale=x.scale * (c if pk == "mul" else 1.0 / c))
        f = _scalar_expr(other)
        if f is None:
            raise _err(node, st, f"{x.name} is combined elementwise with a tensor")
        prev = x.factor if x.factor is not None else const(1.0)
        return replace(x, factor=prev * f if pk == "mul" else prev / f)
    raise _err(node, st, f"unsupported op on attention input {x.name}")


def _gather(node: torch.fx.Node, x: Operand, indices: Sequence[Any], out_shape: tuple[int, ...], st: _State) -> Operand:
    """`cache[table]`: a paged cache [NUM_PAGES, PAGE, Hkv, D] or a token pool [POOL, Hkv, D] read through an
    integer table [B, MAX_PAGES] / [B, MAX_CTX] (a forward input) gives [B, MAX_PAGES, PAGE, Hkv, D] /
    [B, MAX_CTX, Hkv, D]; flattening (page, slot) gives the key axis."""
    table = indices[0] if len(indices) == 1 else None
    if x.labels[:2] == ("b", "s") and isinstance(table, Sym) and len(table.shape) == 1:
        return _token_gather(node, x, table, out_shape, st)
    if x.labels[0] not in ("page", "tok") or not isinstance(table, Sym) or table.expr.op is not ExprOp.LOAD \
            or len(table.shape) != 2:
        raise _err(node, st, f"indexing {x.name} other than as a KV cache read through an integer table of a forward "
                             f"input ({x.name}[block_table] with block_table [B, MAX_PAGES])")
    st.gathers[x.name] = str(table.expr.value)
    head = ("b", "p") if x.labels[0] == "page" else ("b", "s")
    return replace(x, labels=head + x.labels[1:], shape=out_shape)


def _token_gather(node: torch.fx.Node, x: Operand, seq: Sym, out_shape: tuple[int, ...], st: _State) -> Operand:
    """`cache[block_table].flatten(1, 2)[seq]` with seq = searchsorted(offsets, arange(T), right=True) - 1: each packed
    query token t reads the keys of its own sequence (chunked prefill); the token's dim is labelled t."""
    e = seq.expr
    ids = e.args[0] if e.op is ExprOp.SUB and e.args[1] == const(1) else None
    found = (str(ids.value), st.derived[str(ids.value)][0]) if ids is not None and ids.op is ExprOp.LOAD \
        and ids.args == (S.dvar(0),) and st.derived.get(str(ids.value), ("", False))[1] else None
    if found is None or st.token_seq not in (None, found):
        raise _err(node, st, f"indexing the gathered {x.name} per query token other than by the token's sequence "
                             f"({x.name}[block_table].flatten(1, 2)[seq] with seq = torch.searchsorted(query_start_loc, "
                             "torch.arange(T), right=True) - 1)")
    st.token_seq = found
    return replace(x, labels=("t",) + x.labels[1:], shape=out_shape)


def _resolved(x: Operand, st: _State) -> Operand:
    """A 3-D input's first dim ('x') read off where its size-1 dim went: [B, H, D] with `unsqueeze(2)` is one
    query per sequence (x = b); [T, H, D] with `transpose(0, 1).unsqueeze(0)` is packed tokens (x = s)."""
    if "x" not in x.labels or x.labels.count("1") != 1:
        return x
    if x.labels[0] == "1":
        mapping = {"1": "b", "x": "s"}
        st.packed.add(x.name)
    else:
        mapping = {"x": "b", "1": "s"}
    return replace(x, labels=tuple(mapping.get(lab, lab) for lab in x.labels))


def _scalar_expr(x: Any) -> Expr | None:
    """A one-element non-boolean Sym (a run-time scalar such as a learnable temperature) as an expression."""
    if not isinstance(x, Sym) or x.is_bool or math.prod(x.shape) != 1:
        return None
    return substitute(x.expr, {f"_d{i}": const(0) for i in range(len(x.shape))})


def _operand_view(node: torch.fx.Node, x: Operand, out_shape: tuple[int, ...], st: _State) -> Operand:
    if out_shape == x.shape:
        return x
    labels = list(x.labels)
    shape = list(x.shape)
    # merge (page, slot) of a gathered cache into the key axis
    for i in range(len(labels) - 1):
        if labels[i] == "p" and labels[i + 1] == "s" and tuple(shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2:]) == out_shape:
            return replace(x, labels=tuple(labels[:i] + ["s"] + labels[i + 2:]), shape=out_shape)
    # merge (h, g): repeat_interleave-style head expansion
    for i in range(len(labels) - 1):
        if labels[i] == "h" and labels[i + 1] == "g":
            merged = shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2:]
            if tuple(merged) == out_shape:
                return replace(x, labels=tuple(labels[:i] + ["h"] + labels[i + 2:]), shape=out_shape, rep=x.rep * shape[i + 1])
        if labels[i] == "g" and labels[i + 1] == "h":
            raise _err(node, st, f"{x.name}: heads expanded as (group, head), i.e. head j reads kv head j % Hkv; "
                                 "use repeat_interleave(dim=1)")
    # drop inserted size-1 dims
    kept = [(lab, n) for lab, n in zip(labels, shape) if not (lab == "1" and n == 1)]
    if tuple(n for _, n in kept) == out_shape:
        return replace(x, labels=tuple(lab for lab, _ in kept), shape=out_shape)
    raise _err(node, st, f"reshape of {x.name} from {x.shape} to {out_shape} (q, k, v must stay [B, H, S, D])")


def _expect(x: Operand, labels: tuple[str, ...], node: torch.fx.Node, st: _State, what: str) -> None:
    if "x" in x.labels:
        raise _err(node, st, _three_d(x, what))
    if x.labels != labels:
        raise _err(node, st, f"{what}: {x.name} has layout {x.labels}, expected {labels} "
                             "(inputs must be [B, H, S, D])")


def _three_d(x: Operand, what: str) -> str:
    return (f"{what}: {x.name} is a 3-D input used as {x.labels}; reach [B, H, S, D] with {x.name}.unsqueeze(2) for one "
            f"query per sequence ([B, H, D]) or {x.name}.transpose(0, 1).unsqueeze(0) for packed tokens ([T, H, D]), "
            f"or multiply [H, T, D] packed tokens (q.transpose(0, 1) @ k.transpose(0, 1).transpose(1, 2)), or einsum "
            f"'bhd,bhnd->bhn' for one query per sequence")


# The dims of the attention scores, named: b (batch), h (query head), q_idx, kv_idx, and t, a packed query token whose
# keys are its own sequence's (chunked prefill: the cache gathered per token). The layouts a spec may compute them in:
SCORE_LAYOUTS = {("b", "h", "q_idx", "kv_idx"),  # [B, H, M, N]
                 ("b", "h", "kv_idx"),  # one query per sequence without a query axis: einsum("bhd,bhnd->bhn")
                 ("h", "q_idx", "kv_idx"),  # packed tokens as [H, T, D] operands: one batch
                 ("t", "h", "kv_idx")}  # packed query tokens against their sequence's gathered keys: einsum("thd,tnhd->thn")
# (q's label, k's label) of one subscript of Q K^T -> the score dim it is ('x': a 3-D input's first dim, read off here)
_QK_DIMS = {("b", "b"): "b", ("x", "b"): "b", ("h", "h"): "h", ("s", None): "q_idx", (None, "s"): "kv_idx",
            ("x", None): "q_idx", (None, "x"): "kv_idx", ("x", "t"): "t"}
# score dim -> the labels v may have there in P @ V
_PV_DIMS = {"b": ("b",), "h": ("h",), "t": ("t",), "q_idx": (None,), "kv_idx": ("s", "x")}


def _matmul_subscripts(ra: int, rb: int) -> tuple[str, str, str]:
    """torch.matmul of ranks ra, rb >= 2 as einsum subscripts (batch dims broadcast from the right)."""
    n = max(ra, rb) - 2
    batch = "abcdefgh"[:n]
    return batch[n - (ra - 2):] + "MK", batch[n - (rb - 2):] + "KN", batch + "MN"


def _start_scores(node: torch.fx.Node, q: Operand, k: Operand, shape: tuple[int, ...], dims: tuple[str, ...],
                  st: _State) -> Sym:
    """The score Sym (shape as the spec computes it, dims named by `dims`): `score`, times run-time factors of q, k."""
    if st.q is not None:
        raise _err(node, st, "a second QK^T product (only one attention per spec is supported)")
    if q.rep != 1:
        raise _err(node, st, f"{q.name} has repeated heads")
    st.q, st.k, st.score_dims = q, k, dims
    score = var("score")
    for f in (q.factor, k.factor):  # run-time scalars q or k were multiplied by: factors of every score
        if f is not None:
            score = score * f
    return Sym(shape, score, _dtype_of(node))


def _qk_product(node: torch.fx.Node, a: Operand, b: Operand, subscripts: tuple[str, str, str], what: str,
                st: _State) -> Sym:
    """Q K^T with each operand's dims named by subscripts (an einsum's, or a matmul's own): the score dims (one of
    SCORE_LAYOUTS) read off what q and k hold there; the one contracted dim is the head dim of both."""
    la, lb, out = subscripts
    qa, kb = dict(zip(la, a.labels)), dict(zip(lb, b.labels))
    dims = tuple(_QK_DIMS.get((qa.get(c), kb.get(c)), "?") for c in out)
    contracted = (set(la) | set(lb)) - set(out)
    if len(la) != len(a.labels) or len(lb) != len(b.labels) or dims not in SCORE_LAYOUTS or len(contracted) != 1 \
            or any(qa.get(c) != "d" or kb.get(c) != "d" for c in contracted):
        bad = next((x for x in (a, b) if "x" in x.labels), None)
        raise _err(node, st, _three_d(bad, what) if bad is not None else
                   f"{what}: {a.name} {a.labels} and {b.name} {b.labels} do not give the scores of one attention over "
                   "[B, H, S, D] inputs (inputs must be [B, H, S, D])")
    if dims == ("h", "q_idx", "kv_idx") and "x" in a.labels:
        st.packed |= {a.name, b.name}  # [T, H, D] inputs multiplied as [H, T, D]: packed tokens
    return _start_scores(node, a, b, tuple(node.meta["val"].shape), dims, st)


def _pv_product(node: torch.fx.Node, probs: Any, v: Any, subscripts: tuple[str, str, str], what: str,
                st: _State) -> _Output:
    """P @ V with subscripts: P's dims are the scores' (st.score_dims); v holds the keys at P's kv_idx and the head dim
    where the output has it, and matches P's batch, head or token dims; the output is P's dims with kv_idx -> d."""
    if not isinstance(probs, _Probs) or not isinstance(v, Operand):
        raise _err(node, st, "the second matmul must be softmax(scores) @ v")
    if probs.sink is not None:
        raise _err(node, st, "the attention sink's column is still in the probabilities: drop it before the product "
                             "with v (torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1] @ v)")
    lp, lv, out = subscripts
    dims = st.score_dims
    pv = dict(zip(lv, v.labels))
    kv = lp[dims.index("kv_idx")] if len(lp) == len(dims) else ""
    d = [c for c in lv if pv[c] == "d"]
    if len(lp) != len(dims) or len(lv) != len(v.labels) or len(d) != 1 or out != lp.replace(kv, d[0]) \
            or not set(lv) <= set(lp) | set(d) or any(pv.get(c) not in _PV_DIMS[n] for c, n in zip(lp, dims)):
        if "x" in v.labels and dims == ("b", "h", "q_idx", "kv_idx"):
            raise _err(node, st, _three_d(v, what))
        raise _err(node, st, f"{what}: {v.name} {v.labels} does not hold the values of the keys of scores {dims}")
    if pv[kv] == "x":
        st.packed.add(v.name)
    return _finish(node, probs, replace(v, labels=("b", "h", "s", "d")), st)


def _finish(node: torch.fx.Node, probs: Any, v: Any, st: _State) -> _Output:
    if not isinstance(probs, _Probs) or not isinstance(v, Operand):
        raise _err(node, st, "the second matmul must be softmax(scores) @ v")
    v = _resolved(v, st)
    _expect(v, ("b", "h", "s", "d"), node, st, "P @ V")
    if st.k is not None and v.rep != st.k.rep:
        raise _err(node, st, f"k and v heads are repeated differently ({st.k.rep} vs {v.rep})")
    if v.scale != 1.0 or v.factor is not None:
        raise _err(node, st, f"{v.name} is scaled")
    st.v = v
    return _Output()


def _matmul(node: torch.fx.Node, a: Any, b: Any, st: _State) -> Any:
    if isinstance(b, Operand):
        b = _resolved(b, st)
    x, y = node.args[:2]
    assert isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node)  # the tensor operands are graph nodes
    ranks = (len(x.meta["val"].shape), len(y.meta["val"].shape))
    subscripts = _matmul_subscripts(*ranks) if min(ranks) >= 2 else ("", "", "")
    if isinstance(a, Operand) and isinstance(b, Operand):
        return _qk_product(node, _resolved(a, st), b, subscripts, "Q @ K^T", st)
    return _pv_product(node, a, b, subscripts, "P @ V", st)


def _einsum(node: torch.fx.Node, eq: str, ops: list[Any], st: _State) -> Any:
    lhs, out = eq.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ops) != 2 or len(ins) != 2:
        raise _err(node, st, f"einsum {eq!r}")
    a, b = ops
    if isinstance(a, Operand) and isinstance(b, Operand):
        return _qk_product(node, _resolved(a, st), _resolved(b, st), (ins[0], ins[1], out), f"einsum {eq!r}", st)
    if isinstance(a, _Probs) and isinstance(b, Operand):
        return _pv_product(node, a, _resolved(b, st), (ins[0], ins[1], out), f"einsum {eq!r}", st)
    raise _err(node, st, f"einsum {eq!r} on unsupported operands")


# ---------------------------------------------------------------- score-side ops

_BIN = {
    "add": ExprOp.ADD, "sub": ExprOp.SUB, "rsub": ExprOp.SUB, "mul": ExprOp.MUL, "div": ExprOp.DIV,
    "eq": ExprOp.EQ, "ne": ExprOp.NE, "lt": ExprOp.LT, "le": ExprOp.LE, "gt": ExprOp.GT, "ge": ExprOp.GE,
    "bitwise_and": ExprOp.AND, "logical_and": ExprOp.AND, "__and__": ExprOp.AND,
    "bitwise_or": ExprOp.OR, "logical_or": ExprOp.OR, "__or__": ExprOp.OR,
    "maximum": ExprOp.MAXIMUM, "minimum": ExprOp.MINIMUM, "remainder": ExprOp.MOD,
    "floor_divide": ExprOp.FLOORDIV,
    "__lshift__": ExprOp.SHL, "bitwise_left_shift": ExprOp.SHL, "__rshift__": ExprOp.SHR, "bitwise_right_shift": ExprOp.SHR,
}
_UN = {"neg": ExprOp.NEG, "bitwise_not": ExprOp.NOT, "logical_not": ExprOp.NOT, "abs": ExprOp.ABS,
       "exp": ExprOp.EXP, "exp2": ExprOp.EXP2, "log": ExprOp.LOG, "tanh": ExprOp.TANH, "sigmoid": ExprOp.SIGMOID,
       "sqrt": ExprOp.SQRT}
_IDENTITY = {"clone", "contiguous", "alias", "detach", "detach_", "lift_fresh_copy", "lift_fresh"}
_CASTS = {"_to_copy", "to", "type_as"}  # type_as(x, other): x in other's dtype (the node's dtype)


def _cast(x: Sym, dtype: torch.dtype, node: torch.fx.Node, st: _State) -> Sym:
    if dtype == x.dtype:
        return x
    if dtype == torch.bool:
        return Sym(x.shape, x.expr if x.is_bool else x.expr.ne(0), dtype)
    if x.is_bool:
        one, zero = (const(1.0), const(0.0)) if dtype.is_floating_point else (const(1), const(0))
        return Sym(x.shape, call("where", x.expr, one, zero), dtype)
    if x.dtype.is_floating_point and not dtype.is_floating_point:
        if dtype not in (torch.int32, torch.int64):
            raise _err(node, st, f"float to {dtype} cast (only int32 and int64 truncate like the IR's trunc)")
        return Sym(x.shape, call("trunc", x.expr), dtype)  # torch's float -> int cast truncates toward zero
    return replace(x, dtype=dtype)


# ---------------------------------------------------------------- the registry of score/mask ops

ScoreOp = Callable[[str, torch.fx.Node, list[Any], dict[str, Any], _State], Sym]  # (aten op, node, args, kwargs, state)
SCORE_OPS: dict[str, ScoreOp] = {}  # aten op name (overload packet) -> its handler on the score/mask side


def _score_op(*names: str) -> Callable[[ScoreOp], ScoreOp]:
    """Register the decorated handler for the aten ops `names`."""

    def register(fn: ScoreOp) -> ScoreOp:
        for name in names:
            assert name not in SCORE_OPS, f"two handlers for aten op {name}"
            SCORE_OPS[name] = fn
        return fn

    return register


def supported_ops() -> dict[str, tuple[str, ...]]:
    """The aten ops tracing reads, by where they may appear (docs/specs.md lists them; a test keeps the two equal)."""
    return {"score and mask": tuple(sorted(SCORE_OPS)), "q, k, v": tuple(sorted(_LAYOUT | {"index"})),
            "attention": tuple(sorted(_ATTENTION_OPS))}


_REFUSED = {"empty": "uninitialised tensor (torch.empty)",  # ops named with a reason of their own
            "new_empty": "uninitialised tensor (Tensor.new_empty)"}


def _sym_op(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    if pk in _REFUSED:
        raise _err(node, st, _REFUSED[pk])
    handler = SCORE_OPS.get(pk)
    if handler is None:
        raise _unsupported(node, st)
    return handler(pk, node, args, kw, st)


def _unsupported(node: torch.fx.Node, st: _State) -> KBError:
    return _err(node, st, "unsupported op in the score/mask computation",
                hint=f"supported there: {', '.join(sorted(SCORE_OPS))}; see docs/specs.md for the supported attention patterns")


def _out_shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    return tuple(node.meta["val"].shape) if isinstance(node.meta.get("val"), torch.Tensor) else None


@_score_op(*_IDENTITY)
def _identity(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    return _sym(args[0], node, st)


@_score_op(*_CASTS)
def _cast_op(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    return _cast(_sym(args[0], node, st), _dtype_of(node), node, st)


@_score_op(*_BIN)
def _binary(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    dt = _dtype_of(node)
    if pk == "div" and kw.get("rounding_mode") == "floor":
        return S.binary(ExprOp.FLOORDIV, _sym(args[0], node, st), _sym(args[1], node, st), dt)
    if pk == "div" and kw.get("rounding_mode") == "trunc":
        raise _err(node, st, "truncating division")
    a, b = _sym(args[0], node, st), _sym(args[1], node, st)
    if pk == "rsub":
        a, b = b, a
    alpha = kw.get("alpha", args[2] if len(args) > 2 else 1)
    if pk in ("add", "sub", "rsub") and alpha != 1:
        b = S.binary(ExprOp.MUL, b, S.scalar_sym(alpha))
    return S.binary(_BIN[pk], a, b, dt)


@_score_op("pow")
def _pow(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    dt = _dtype_of(node)
    a, b = args[0], args[1]
    if isinstance(b, (int, float)) and b in (2, 0.5, -0.5):
        x = _sym(a, node, st)
        if b == 2:
            return S.binary(ExprOp.MUL, x, x, dt)
        r = S.unary(ExprOp.SQRT, x, dt)
        return r if b == 0.5 else S.binary(ExprOp.DIV, S.scalar_sym(1.0), r, dt)
    if isinstance(a, (int, float)) and a == 2:
        return S.unary(ExprOp.EXP2, _sym(b, node, st), dt)
    raise _err(node, st, "power other than x**2, x**0.5, 2**x")


@_score_op("rsqrt")
def _rsqrt(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    return S.binary(ExprOp.DIV, S.scalar_sym(1.0), S.unary(ExprOp.SQRT, _sym(args[0], node, st)), _dtype_of(node))


@_score_op(*_UN)
def _unary(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    return S.unary(_UN[pk], _sym(args[0], node, st), _dtype_of(node))


@_score_op("min", "max")
def _min_max(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    if len(args) != 2 or not isinstance(args[1], Sym):
        raise _err(node, st, f"torch.{pk} as a reduction (only the elementwise torch.{pk}(a, b) of two tensors)")
    return S.binary(ExprOp.MINIMUM if pk == "min" else ExprOp.MAXIMUM, args[0], args[1], _dtype_of(node))


@_score_op("where", "masked_fill")
def _where_op(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    if pk == "where":
        c, x, y = (_sym(a, node, st) for a in args)
    else:
        y, c, x = (_sym(a, node, st) for a in args)
    return S.where(c, x, y, _dtype_of(node))


@_score_op("clamp")
def _clamp(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    dt = _dtype_of(node)
    x = _sym(args[0], node, st)
    lo = args[1] if len(args) > 1 else kw.get("min")
    hi = args[2] if len(args) > 2 else kw.get("max")
    if lo is not None:
        x = S.binary(ExprOp.MAXIMUM, x, _sym(lo, node, st), dt)
    if hi is not None:
        x = S.binary(ExprOp.MINIMUM, x, _sym(hi, node, st), dt)
    return x


@_score_op("view", "reshape", "_unsafe_view")
def _view(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    return S.view(_sym(args[0], node, st), args[1])


@_score_op("flatten")
def _flatten(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    shape = _out_shape(node)
    if shape is None:
        raise _unsupported(node, st)
    return S.view(_sym(args[0], node, st), shape)


@_score_op("unsqueeze")
def _unsqueeze(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    return S.unsqueeze(_sym(args[0], node, st), args[1])


@_score_op("squeeze")
def _squeeze(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    dims = args[1] if len(args) > 1 else None
    return S.squeeze(_sym(args[0], node, st), [dims] if isinstance(dims, int) else dims)


@_score_op("expand")
def _expand(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    return S.expand(_sym(args[0], node, st), args[1])


@_score_op("permute", "transpose", "t", "mT")
def _permute(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    x = _sym(args[0], node, st)
    n = len(x.shape)
    if pk == "permute":
        perm = list(args[1])
    else:
        a, b = (args[1] % n, args[2] % n) if pk == "transpose" else (n - 2, n - 1) if pk == "mT" else (0, 1)
        perm = list(range(n))
        perm[a], perm[b] = perm[b], perm[a]
    return S.permute(x, perm)


@_score_op("slice")
def _slice(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    x = _sym(args[0], node, st)
    dim = args[1] if len(args) > 1 else 0
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    return S.slice_(x, dim, start, end if end is None or end < 2**62 else None, step)


@_score_op("select")
def _select(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    return S.select(_sym(args[0], node, st), args[1], args[2])


@_score_op("index")
def _index(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    # sequence ids from offsets (searchsorted right, >= 1 at every position of offsets that start at 0) minus 1 index
    # a per-sequence table without wrapping around
    derived = {n: t for n, t in st.aux.items() if n in st.derived and st.derived[n][1]}
    return S.index(_sym(args[0], node, st), [None if i is None else _sym(i, node, st) for i in args[1]], known=derived)


@_score_op("tril", "triu")
def _tril(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    x = _sym(args[0], node, st)
    diag = args[1] if len(args) > 1 else kw.get("diagonal", 0)
    return S.tril(x, diag) if pk == "tril" else S.triu(x, diag)


@_score_op("arange")
def _arange(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    nums = [a for a in args if isinstance(a, (int, float))]
    start, end, step = (0, nums[0], 1) if len(nums) == 1 else (nums[0], nums[1], nums[2] if len(nums) > 2 else 1)
    return S.arange(start, end, step, _dtype_of(node))


@_score_op("ones", "zeros", "full", "scalar_tensor")
def _full(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    value = {"ones": 1, "zeros": 0}.get(pk, args[1] if pk == "full" else args[0])
    return S.full(_out_shape(node) or (), value, _dtype_of(node))


@_score_op("ones_like", "zeros_like", "full_like")
def _full_like(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    value = {"ones_like": 1, "zeros_like": 0}.get(pk, args[1] if len(args) > 1 else 0)
    return S.full(_out_shape(node) or (), value, _dtype_of(node))


@_score_op("new_ones", "new_zeros", "new_full")
def _new_full(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    """`x.new_ones(size)` and kin (FlexAttention's `and_masks`, `or_masks` and `noop_mask` start from one)."""
    value = {"new_ones": 1, "new_zeros": 0}.get(pk, args[2] if len(args) > 2 else kw.get("fill_value", 0))
    return S.full(_out_shape(node) or (), value, _dtype_of(node))


@_score_op("gelu")
def _gelu(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    """`F.gelu(x)`: x * (1 + erf(x / sqrt(2))) / 2; approximate="tanh": x * (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) / 2."""
    arg = _sym(args[0], node, st)
    x = arg.expr
    approximate = args[1] if len(args) > 1 else kw.get("approximate", "none")
    if approximate == "tanh":
        gate = call("tanh", math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x)))
    else:
        gate = call("erf", x * (1.0 / math.sqrt(2.0)))
    e = x * 0.5 * (1.0 + gate)
    return Sym(arg.shape, e, _dtype_of(node))


@_score_op("silu")
def _silu(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    x = _sym(args[0], node, st)
    return Sym(x.shape, x.expr * call("sigmoid", x.expr), _dtype_of(node))


@_score_op("relu")
def _relu(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    x = _sym(args[0], node, st)
    return S.binary(ExprOp.MAXIMUM, x, S.scalar_sym(0.0 if x.dtype.is_floating_point else 0), _dtype_of(node))


_REDUCE = {"any": ExprOp.OR, "all": ExprOp.AND, "sum": ExprOp.ADD}


@_score_op(*_REDUCE)
def _reduction(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    """`x.any(dim)`, `x.all(dim)`, `x.sum(dim)` over a dim of a loaded table (VSA's top-k membership test),
    unrolled into one term per element (at most spec_sym.UNROLL_LIMIT)."""
    x = _sym(args[0], node, st)
    dims = args[1] if len(args) > 1 else kw.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kw.get("keepdim", False))
    dtype = _dtype_of(node)
    x = _cast(x, torch.bool if pk != "sum" else dtype, node, st)
    return _unrolled(node, st, x, [dims] if isinstance(dims, int) else dims, _REDUCE[pk], keepdim, dtype)


@_score_op("dot")
def _dot(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    """`torch.dot(a, b)` of two 1-D vectors (MLA's decoupled RoPE term), unrolled as sum(a[i] * b[i])."""
    prod = S.binary(ExprOp.MUL, _sym(args[0], node, st), _sym(args[1], node, st), _dtype_of(node))
    return _unrolled(node, st, prod, [0], ExprOp.ADD, False, _dtype_of(node))


def _unrolled(node: torch.fx.Node, st: _State, x: Sym, dims: Sequence[int] | None, op: ExprOp, keepdim: bool,
              dtype: torch.dtype) -> Sym:
    try:
        return S.reduce(x, dims, op, keepdim, dtype)
    except KBError as err:
        raise _err(node, st, str(err)) from None


@_score_op("embedding")
def _embedding(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    """`F.embedding(indices, weight)` / `nn.Embedding(...)(indices)`: rows of a [num, dim] table, `weight[indices, :]`
    (aten's argument order is (weight, indices, ...); padding_idx only changes the gradient)."""
    weight, ix = _sym(args[0], node, st), _sym(args[1], node, st)
    if len(weight.shape) != 2:
        raise _err(node, st, f"embedding of a {len(weight.shape)}-D table (an embedding table is [num, dim])")
    if ix.is_bool or ix.dtype.is_floating_point:
        raise _err(node, st, f"embedding indexed by a {ix.dtype} tensor (indices must be integers)")
    return S.index(weight, [ix, None], wrap=False)


@_score_op("cat")
def _cat(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    """`torch.cat([scores, sink], dim=-1)`: an attention sink's logit as one more column of the scores, which the
    softmax then sees and `[..., :-1]` drops (gpt-oss). Read as `where(j < N, scores, sink)` (see `_split_sink`)."""
    parts = [_sym(a, node, st) for a in args[0]]
    shape = _out_shape(node)
    dim = args[1] if len(args) > 1 else kw.get("dim", 0)
    if shape is None or len(parts) != 2 or dim % len(shape) != len(shape) - 1 or st.sink_cat is not None \
            or "score" not in free_vars(parts[0].expr) or "score" in free_vars(parts[1].expr) or parts[1].shape[-1] != 1:
        raise _err(node, st, "torch.cat other than of one attention-sink column after the scores: write "
                             "torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] with sink [B, H, M, 1]")
    last, n = len(shape) - 1, parts[0].shape[-1]
    keys = S.broadcast_to(parts[0], shape[:-1] + (n,))
    sink = substitute(S.broadcast_to(parts[1], shape[:-1] + (1,)).expr, {f"_d{last}": const(0)})
    st.sink_cat = n
    return Sym(shape, call("where", S.dvar(last) < n, keys.expr, sink), _dtype_of(node))


@_score_op("searchsorted")
def _searchsorted(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Sym:
    """`torch.searchsorted(offsets, arange(S), right=...)`: per-position ids from a 1-D forward input (document
    ids from cu_seqlens). The kernel reads them as a derived aux tensor that the candidate computes from the
    offsets before each launch (one small op; the block table is then built once per id tensor)."""
    seq, pos = _sym(args[0], node, st), _sym(args[1], node, st)
    src = seq.expr.value if seq.expr.op is ExprOp.LOAD else None
    if len(seq.shape) != 1 or src not in st.aux or seq.expr.args != (S.dvar(0),) or src in st.state \
            or pos.shape == () or len(pos.shape) != 1 or pos.expr != S.dvar(0) or kw.get("sorter") is not None:
        raise _err(node, st, "torch.searchsorted other than of a 1-D forward input (offsets) at the positions "
                   "torch.arange(S)")
    right = bool(kw.get("right", False)) or kw.get("side") == "right"
    name = f"{src}_{'right' if right else 'left'}_ids"
    st.aux[name] = torch.searchsorted(st.aux[src], torch.arange(pos.shape[0], dtype=st.aux[src].dtype), right=right,
                                      out_int32=bool(kw.get("out_int32", False)))
    st.derived[name] = (src, right)
    return S.load_leaf(name, st.aux[name])


# ---------------------------------------------------------------- softmax: name dims, split mask


def _split_mask(e: Expr) -> tuple[Expr, Expr | None]:
    """Split logits into (finite score part, attend condition or None = always attend)."""
    if S.is_neg_inf(e):
        return const(0.0), const(False)
    if e.op is ExprOp.WHERE:
        c, x, y = e.args
        fx, cx = _split_mask(x)
        fy, cy = _split_mask(y)
        if cx is None and cy is None:
            return e, None
        if cy == const(False):
            return fx, _and(c, cx)
        if cx == const(False):
            return fy, _and(~c, cy)
        return call("where", c, fx, fy), call("where", c, cx or const(True), cy or const(True))
    if e.op in (ExprOp.ADD, ExprOp.SUB):
        x, y = e.args
        fx, cx = _split_mask(x)
        fy, cy = (y, None) if e.op is ExprOp.SUB else _split_mask(y)
        if cx is None and cy is None:
            return e, None
        return Expr(e.op, (fx, fy)), _and(cx, cy)
    if e.op in (ExprOp.MUL, ExprOp.DIV) and e.args[1].op is ExprOp.CONST and number(e.args[1]) > 0:
        fx, cx = _split_mask(e.args[0])
        return (e, None) if cx is None else (Expr(e.op, (fx, e.args[1])), cx)
    return e, None


def _and(a: Expr | None, b: Expr | None) -> Expr | None:
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def _per_sequence(e: Expr, ids: str, offsets: str) -> Expr:
    """Scores of packed query tokens t (chunked prefill) as scores of (sequence b, its query q_idx): token q_idx of
    sequence b is t = offsets[b] + q_idx, and its sequence id ids[t] (searchsorted right) is b + 1."""
    b1 = var("b") + 1

    def seq(n: Expr) -> Expr:
        if n.op is ExprOp.LOAD and n.value == ids and n.args == (var("t"),):
            return b1
        return Expr(n.op, tuple(seq(a) for a in n.args), n.value) if n.args else n

    start = load(offsets, var("b"))

    def cancel(n: Expr) -> Expr:  # (offsets[b] + x) - offsets[b] -> x: the token's position in its chunk
        n = Expr(n.op, tuple(cancel(a) for a in n.args), n.value) if n.args else n
        if n.op is ExprOp.SUB and n.args[0].op is ExprOp.ADD and n.args[0].args[0] == n.args[1] == start:
            return n.args[0].args[1]
        return n

    return simplify(cancel(simplify(substitute(seq(e), {"t": start + var("q_idx")}))))


def _extract_scale(e: Expr) -> tuple[Expr, float]:
    """If every `score` sits in `score * c` (same c), fold c into the softmax scale."""
    factors = {float(number(n.args[1])) for n in walk(e)
               if n.op is ExprOp.MUL and n.args[0] == var("score") and n.args[1].op is ExprOp.CONST}
    n_score = sum(1 for n in walk(e) if n == var("score"))
    n_scaled = sum(1 for n in walk(e) if n.op is ExprOp.MUL and n.args[0] == var("score") and n.args[1].op is ExprOp.CONST)
    if len(factors) != 1 or n_scaled != n_score:
        return e, 1.0
    c = factors.pop()

    def strip(n: Expr) -> Expr:
        if n.op is ExprOp.MUL and n.args[0] == var("score") and n.args[1].op is ExprOp.CONST:
            return var("score")
        return Expr(n.op, tuple(strip(a) for a in n.args), n.value) if n.args else n

    return strip(e), c


def _normalize_scale(e: Expr) -> Expr:
    """`score / c` -> `score * (1/c)` and `c * score` -> `score * c`, so scale extraction sees one form."""
    if not e.args:
        return e
    e = Expr(e.op, tuple(_normalize_scale(a) for a in e.args), e.value)
    if e.op is ExprOp.DIV and e.args[0] == var("score") and e.args[1].op is ExprOp.CONST:
        return var("score") * (1.0 / number(e.args[1]))
    if e.op is ExprOp.MUL and e.args[1] == var("score") and e.args[0].op is ExprOp.CONST:
        return var("score") * e.args[0]
    return e


def _variants(logits: Sym, node: torch.fx.Node, st: _State) -> tuple[Expr | None, Expr | None, float]:
    named = substitute(logits.expr, {f"_d{k}": var(n) for k, n in enumerate(st.score_dims)})
    if st.token_seq is not None:
        named = _per_sequence(named, *st.token_seq)
    named = simplify(named)
    score, mask = _split_mask(named)
    score = simplify(_normalize_scale(simplify(score)))
    score, c = _extract_scale(score)
    score = simplify(score)
    if mask is not None:
        mask = simplify(mask)
        if "score" in free_vars(mask):
            raise _err(node, st, "the mask depends on score values")
        if mask == const(True):
            mask = None
    return (None if score == var("score") else score), mask, c


# ---------------------------------------------------------------- the interpreter


def _operand_inputs(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Placeholders that reach a matmul/einsum/SDPA operand through layout ops only."""
    found: set[torch.fx.Node] = set()

    def back(n: Any) -> None:
        if not isinstance(n, torch.fx.Node):
            return
        if n.op == "placeholder":
            found.add(n)
        elif n.op == "call_function" and _packet(n) in _LAYOUT | _GATHERS | {"index"}:  # index: cache[table]
            back(n.args[0])
            if _packet(n) in ("mul", "div") and len(n.args) > 1:
                back(n.args[1])

    for n in gm.graph.nodes:
        if n.op == "call_function":
            pk = _packet(n)
            if pk in ("matmul", "bmm"):
                back(n.args[0])
                back(n.args[1])
            elif pk == "einsum":
                for a in n.args[1]:
                    back(a)
            elif pk == "scaled_dot_product_attention":
                for a in n.args[:3]:
                    back(a)
    return found


_PRODUCTS = ("matmul", "bmm", "einsum", "scaled_dot_product_attention")
_INDEXING = {"select", "slice", "index", "unbind", "split", "split_with_sizes", "chunk", "narrow", "getitem",
             "unsafe_split", "unsafe_chunk", "tensor_split"}


def _sources(n: Any) -> tuple[set[torch.fx.Node], bool]:
    """Placeholders that `n` is a view or a slice of, and whether indexing was crossed on the way."""
    found: set[torch.fx.Node] = set()
    indexed = False
    todo = [n]
    while todo:
        x = todo.pop()
        if not isinstance(x, torch.fx.Node):
            continue
        if x.op == "placeholder":
            found.add(x)
            continue
        pk = "getitem" if x.target is operator.getitem else _packet(x) if x.op == "call_function" else ""
        if pk in _INDEXING:
            indexed = True
            todo.append(x.args[0])
        elif pk in _LAYOUT:
            todo.append(x.args[0])
    return found, indexed


def _product_operands(n: torch.fx.Node) -> list[Any]:
    pk = _packet(n)
    if pk == "einsum":
        operands = n.args[1]  # einsum(equation, [operands])
        assert isinstance(operands, (list, tuple))
        return list(operands)
    return list(n.args[:3] if pk == "scaled_dot_product_attention" else n.args[:2])


def _check_structure(gm: torch.fx.GraphModule, input_names: list[str], st: _State) -> None:
    """Name the constructs that would otherwise surface as a misleading error at some matmul:
    a Python loop over heads (or several attentions) and q, k, v sliced out of one packed tensor."""
    products = [n for n in gm.graph.nodes if n.op == "call_function" and _packet(n) in _PRODUCTS]
    if not products:
        return
    names = {p: name for p, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], input_names)}
    first = products[0]
    srcs = [_sources(a) for a in _product_operands(first)]
    places = [s for s, _ in srcs]
    if len(places) >= 2 and len(places[0] | places[1]) == 1 and places[0] and all(ix for _, ix in srcs[:2]):
        (p,) = places[0]
        raise _err(first, st, f"q, k, v sliced from a packed qkv tensor ({names.get(p, p.name)!r}) by indexing is not "
                              "supported; pass q, k, v separately as [B, H, S, D] tensors")
    sdpa = sum(1 for n in products if _packet(n) == "scaled_dot_product_attention")
    count = len(products) + sdpa  # SDPA is both products
    if count <= 2:
        return
    if any(ix for _, ix in srcs):
        raise _err(first, st, f"a Python loop over heads (torch.fx saw {count} matmuls, each on a slice of the "
                              "inputs); write the attention once over [B, H, S, D] tensors")
    third = products[1] if _packet(first) == "scaled_dot_product_attention" else products[min(2, len(products) - 1)]
    raise _err(third, st,
               f"several attentions in one spec (torch.fx saw {count} matmuls); a spec holds one attention "
               "softmax(q @ k^T) @ v over [B, H, S, D] tensors")


def _record(fn: Callable[..., Any], inputs: Sequence[Any], what: str, source: str | None = None,
            input_names: Sequence[str] = ()) -> torch.fx.GraphModule:
    try:
        return record_graph(fn, inputs)
    except KBError:
        raise
    except Exception as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        at = _user_line(err, source)
        offsets = _offsets_input(inputs, input_names)
        if offsets is not None and "data-dependent" in str(err):
            raise KBError(f"a Python loop over sequences reading {offsets} values (int(), .item(), slicing by them) {at}: "
                          f"write one attention over the packed tokens [T, H, D] with a block-diagonal mask from {offsets}",
                          hint="see docs/specs.md, serving specs") from None
        raise KBError(f"cannot trace {what}: {msg}" + (f" ({at})" if source else ""),
                      hint="data-dependent Python control flow and .item() are not supported") from None


def _user_line(err: BaseException, source: str | None) -> str:
    """`at FILE:LINE: code` of the deepest frame of the spec file in err's traceback."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == source]
    if not frames:
        return "at an unknown line"
    f = frames[-1]
    return f"at {f.filename}:{f.lineno}: {(f.line or '').strip()}"


def _offsets_input(inputs: Sequence[Any], names: Sequence[str]) -> str | None:
    """The name of a 1-D integer input (sequence offsets, cu_seqlens) beside 3-D float inputs (packed tokens)."""
    floats = [x for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()]
    ints = [n for x, n in zip(inputs, names) if isinstance(x, torch.Tensor) and x.dim() == 1 and not x.is_floating_point()]
    return ints[0] if ints and floats and all(x.dim() == 3 for x in floats) else None


# names kernels give their own params and variant arguments: an aux tensor never takes one (`self.q` -> `q_aux`)
_PROGRAM_NAMES = frozenset({"q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv", "sm_scale", "score", "b", "h", "q_idx",
                            "kv_idx", "inf", "B", "Hq", "Hkv", "M", "N", "D", "Dv", *SCHEDULE_CONSTANTS})


def aux_name(key: str) -> str:
    """The aux tensor name of a captured tensor's name (`attn.rel_bias` -> `attn_rel_bias`, `q` -> `q_aux`, a name of
    the generated host code: `table` -> `table_aux`, `_mask` -> `mask_aux`)."""
    name = re.sub(r"\W", "_", key)
    if name in _PROGRAM_NAMES or keyword.iskeyword(name) or host_name_clash(name):
        return f"{name.lstrip('_') or 'x'}_aux"
    return name


def tensor_namer(named: list[tuple[str, torch.Tensor]]) -> NameOf:
    """Find a captured tensor's name by identity, else by storage (views of a buffer)."""

    def name_of(t: torch.Tensor) -> str | None:
        for n, x in named:
            if x is t:
                return n
        for n, x in named:
            if x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and x.shape == t.shape \
                    and x.stride() == t.stride() and x.storage_offset() == t.storage_offset():
                return n
        for n, x in named:
            if x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                return n
        return None

    return name_of


def _runtime_leaf(name: str, t: torch.Tensor, st: _State) -> Sym:
    """A tensor the kernel reads at run time: a load, never a constant. A 0-dim tensor is read
    as `name[0]` of a [1]-shaped aux tensor (the candidate passes `x.reshape(1)`)."""
    if t.dim() == 0:
        st.aux[name] = t.detach().reshape(1).clone()
        return Sym(tuple(t.shape), load(name, const(0)), t.dtype)
    st.aux[name] = t.detach().clone()
    return S.load_leaf(name, t)


def _attr_leaf(gm: torch.fx.GraphModule, node: torch.fx.Node, st: _State) -> Sym:
    t = getattr(gm, str(node.target))
    key = st.name_of(t)
    if key is None:
        name = f"const{st.n_const}"
        st.n_const += 1
    else:
        name = aux_name(key)
    state_key = key if key is not None and key in st.state_kinds else None  # the state_dict key of a parameter or buffer
    if state_key is not None and (st.state_kinds[state_key] == "parameter" or t.numel() == 1):
        # learnable (or loadable) state: its value at call time, not at trace time
        st.state[name] = state_key
        return _runtime_leaf(name, t, st)
    leaf = _const_leaf(t, name)
    if state_key is not None and not any(n.op is ExprOp.LOAD for n in walk(leaf.expr)):
        st.baked.add(state_key)
    if leaf.expr.op is ExprOp.LOAD or any(n.op is ExprOp.LOAD for n in walk(leaf.expr)):
        base, i = name, 1
        while name in st.aux and not torch.equal(st.aux[name], t):
            name = f"{base}_{i}"
            i += 1
        st.aux[name] = t.detach().clone()
        if state_key is not None:
            st.state[name] = state_key
        leaf = S.load_leaf(name, t)
    return leaf


def _run(gm: torch.fx.GraphModule, env: dict[torch.fx.Node, Any], st: _State) -> Any:
    for node in gm.graph.nodes:
        if node in env:
            continue
        if node.op == "get_attr":
            env[node] = _attr_leaf(gm, node, st)
            continue
        if node.op == "output":
            out = node.args[0]
            return env[out[0]] if isinstance(out, (tuple, list)) else env[out]
        if node.op != "call_function":
            raise _err(node, st, f"unsupported graph node {node.op}")
        args = [_lookup(a, env) for a in node.args]
        kw = {k: _lookup(a, env) for k, a in node.kwargs.items()}
        env[node] = _step(node, args, kw, st)
    raise AssertionError("graph without output")


def _lookup(a: Any, env: dict[torch.fx.Node, Any]) -> Any:
    if isinstance(a, torch.fx.Node):
        return env[a]
    if isinstance(a, (list, tuple)):
        return type(a)(_lookup(x, env) for x in a)
    return a


def _step(node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Any:
    pk = _packet(node)
    if node.target is operator.getitem:
        return args[0][args[1]]
    first = args[0] if args else None
    if pk in _ATTENTION_OPS:
        return _ATTENTION_OPS[pk](pk, node, args, kw, st)
    if isinstance(first, Operand):
        return _operand_op(pk, node, first, args, st)
    if pk in ("mul", "div") and len(args) > 1 and isinstance(args[1], Operand):
        return _operand_op(pk, node, args[1], args, st)
    if isinstance(first, _Probs):
        if pk in _IDENTITY | _CASTS:
            return first
        if _sink_dropped(node, first, args):
            return _Probs()
        if first.sink is not None:
            raise _err(node, st, "the attention sink's column must be dropped right after the softmax, as p[..., :-1]")
        raise _err(node, st, "op between softmax and the product with v")
    if isinstance(first, _Output):
        if pk in _IDENTITY | _CASTS or (pk in _OUTPUT_LAYOUT and (st.gathers or st.packed)):
            return first  # a serving spec's own output layout: its reference maps it back (generate.spec_serving)
        raise _err(node, st, "op after the attention output (the spec must return softmax(...) @ v as [B, H, M, D])")
    if (base := _inplace_base(pk)) is not None:
        _check_inplace(node, st)
        pk = base
    return _sym_op(pk, node, args, kw, st)


# in-place forms (`x += y` is add_) traced as their out-of-place op, when no alias of x outlives the update
_INPLACE = {"add", "sub", "mul", "div", "clamp", "masked_fill", "abs", "neg", "exp", "log", "bitwise_and",
            "bitwise_or", "logical_and", "logical_or", "logical_not", "bitwise_not", "remainder", "floor_divide",
            "maximum", "minimum", "tanh", "sigmoid", "sqrt"}
_ALIASING = {"view", "reshape", "_unsafe_view", "expand", "permute", "transpose", "t", "mT", "unsqueeze", "squeeze",
             "slice", "select", "alias", "detach", "as_strided", "narrow", "diagonal", "unfold", "flatten",
             "view_as", "unflatten", "movedim", "expand_as", "split", "chunk", "unbind", "split_with_sizes"}


def _inplace_base(pk: str) -> str | None:
    return pk[:-1] if pk.endswith("_") and not pk.startswith("_") and pk[:-1] in _INPLACE else None


def _check_inplace(node: torch.fx.Node, st: _State) -> None:
    """An in-place update equals its out-of-place op only if nothing else sees the old tensor's storage: the
    updated tensor is no view, and every other use of it (a view of it included) comes before the update."""
    target = node.args[0]
    if not isinstance(target, torch.fx.Node):
        return
    if target.op in ("placeholder", "get_attr"):
        raise _err(node, st, f"in-place {_packet(node)} of a forward input or of the Model's state (each call would "
                             "change it; compute a new tensor instead)")
    if target.op == "call_function" and _packet(target) in _ALIASING:
        raise _err(node, st, f"in-place {_packet(node)} on a view (write x = x + y, or update the tensor itself)")
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    later = [u for u in target.users if u is not node and order[u] > order[node]]
    viewed = [u for u in target.users if u is not node and u.op == "call_function" and _packet(u) in _ALIASING]
    if later or viewed:
        raise _err(node, st, f"in-place {_packet(node)} of a tensor also used elsewhere (write x = x + y instead)")


def _softmax(node: torch.fx.Node, args: list[Any], st: _State) -> _Probs:
    x = args[0]
    if not isinstance(x, Sym) or "score" not in free_vars(x.expr):
        raise _err(node, st, "softmax of something other than the attention scores")
    if args[1] % len(x.shape) != len(x.shape) - 1 or len(x.shape) != len(st.score_dims):
        raise _err(node, st, "softmax over a dim other than the last of [B, H, M, N]")
    if st.logits is not None:
        raise _err(node, st, "a second softmax")
    st.softmax_node = node
    if st.sink_cat is None:
        st.logits = x
        return _Probs()
    st.logits, st.sink = _split_sink(x, st.sink_cat, node, st)
    return _Probs(sink=st.sink_cat)


def _split_sink(x: Sym, n: int, node: torch.fx.Node, st: _State) -> tuple[Sym, Expr]:
    """Logits [..., n + 1] whose last column is an attention sink (see `_cat`) -> (the key logits [..., n], the sink
    logit named by (b, h)). `where(j < n, keys, sink)` marks the column: the keys take its first branch, the sink its
    second with j = n, so ops applied after the cat (a scale, a cast) apply to both, exactly."""
    last = len(x.shape) - 1
    marker = S.dvar(last) < n

    def pick(e: Expr, branch: int) -> Expr:
        if e.op is ExprOp.WHERE and e.args[0] == marker:
            return pick(e.args[branch], branch)
        return Expr(e.op, tuple(pick(a, branch) for a in e.args), e.value) if e.args else e

    keys = Sym(x.shape[:-1] + (n,), pick(x.expr, 1), x.dtype)
    sink = substitute(pick(x.expr, 2), {f"_d{last}": const(n)})
    named = simplify(substitute(sink, {f"_d{k}": var(name) for k, name in enumerate(st.score_dims)}))
    if free_vars(named) - {"b", "h"}:
        raise _err(node, st, f"an attention sink that depends on {', '.join(sorted(free_vars(named) - {'b', 'h'}))} "
                             "(a sink is one logit per batch and head, e.g. self.sinks[h])")
    return keys, named


def _sink_dropped(node: torch.fx.Node, p: _Probs, args: list[Any]) -> bool:
    """`p[..., :-1]` (or `[..., :n]`) of probabilities with a sink column: the keys' probabilities."""
    if p.sink is None or _packet(node) != "slice":
        return False
    ndim = len(node.meta["val"].shape)
    dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
    return dim % ndim == ndim - 1 and start in (0, None) and end in (-1, p.sink) and step == 1


def _sdpa(node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> _Output:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    a = dict(zip(names, args)) | kw
    q, k, v = a["query"], a["key"], a["value"]
    if not all(isinstance(x, Operand) for x in (q, k, v)):
        raise _err(node, st, "scaled_dot_product_attention on non-input tensors")
    q, k, v = (_resolved(x, st) for x in (q, k, v))
    if a.get("dropout_p", 0.0):
        raise _err(node, st, f"scaled_dot_product_attention with dropout_p={a['dropout_p']}")
    if a.get("enable_gqa") and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = replace(k, rep=k.rep * rep), replace(v, rep=v.rep * rep)
    _expect(q, ("b", "h", "s", "d"), node, st, "sdpa")
    _expect(k, ("b", "h", "s", "d"), node, st, "sdpa")
    scores = _start_scores(node, q, k, (*q.shape[:3], k.shape[2]), ("b", "h", "q_idx", "kv_idx"), st)
    scale = a.get("scale")
    d = q.shape[3]
    sc = S.binary(ExprOp.MUL, scores, S.scalar_sym(float(scale) if scale is not None else 1.0 / math.sqrt(d)))
    m = a.get("attn_mask")
    if m is not None:
        m = _sym(m, node, st)
        sc = S.where(m, sc, S.scalar_sym(-math.inf), sc.dtype) if m.is_bool else S.binary(ExprOp.ADD, sc, m)
    if a.get("is_causal"):
        causal = Sym((1, 1, sc.shape[2], sc.shape[3]), S.dvar(3) <= S.dvar(2), torch.bool)
        sc = S.where(causal, sc, S.scalar_sym(-math.inf), sc.dtype)
    st.logits = sc
    st.softmax_node = node
    return _finish(node, _Probs(), v, st)


def _dropout(pk: str, node: torch.fx.Node, args: list[Any], kw: dict[str, Any], st: _State) -> Any:
    p, train = args[1], args[2] if len(args) > 2 else kw.get("train", True)
    if train and p > 0:
        raise _err(node, st, f"dropout(p={p}) in training mode (call model.eval() or drop it)")
    return (args[0], None) if pk == "native_dropout" else args[0]


# the attention's own ops, whatever their operands: the two products, softmax, (eval-mode) dropout
_ATTENTION_OPS: dict[str, Callable[[str, torch.fx.Node, list[Any], dict[str, Any], _State], Any]] = {
    "matmul": lambda pk, node, args, kw, st: _matmul(node, args[0], args[1], st),
    "bmm": lambda pk, node, args, kw, st: _matmul(node, args[0], args[1], st),
    "einsum": lambda pk, node, args, kw, st: _einsum(node, args[0], list(args[1]), st),
    "scaled_dot_product_attention": lambda pk, node, args, kw, st: _sdpa(node, args, kw, st),
    **dict.fromkeys(("softmax", "_softmax", "_safe_softmax"), lambda pk, node, args, kw, st: _softmax(node, args, st)),
    **dict.fromkeys(("dropout", "native_dropout", "feature_dropout"), _dropout),
}


def trace_attention(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    input_names: Sequence[str],
    name_of: NameOf,
    source: str | None = None,
    state_kinds: Mapping[str, str] | None = None,
) -> TracedAttention:
    """Trace `fn(*inputs)` (an attention forward) into variant expressions.

    `state_kinds` maps the names `name_of` gives to the Model's state_dict entries to
    "parameter" or "buffer": those stay run-time inputs of the kernel (never folded into
    constants), except buffers whose values equal an index expression (recorded in `baked`)."""
    inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    gm = _record(fn, inputs, "the spec's forward", source, input_names)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    st = _State(names={}, name_of=name_of, source=source, state_kinds=state_kinds or {})
    _check_structure(gm, list(input_names), st)
    operands = _operand_inputs(gm)
    caches = _gathered_inputs(gm)
    env: dict[torch.fx.Node, Any] = {}
    for node, name, x in zip(placeholders, input_names, inputs):
        if not isinstance(x, torch.Tensor):
            env[node] = x
        elif node in operands:
            env[node] = Operand(name, _input_labels(x.dim(), node in caches), tuple(x.shape))
        else:
            env[node] = _runtime_leaf(name, x, st)  # an extra forward input: its value at call time
    out = _run(gm, env, st)
    if not isinstance(out, _Output) or st.logits is None or st.softmax_node is None \
            or st.q is None or st.k is None or st.v is None:
        raise KBError("the spec's forward does not compute softmax(q @ k^T) @ v (no attention pattern found)",
                      hint="see docs/specs.md for the supported attention patterns")
    score, mask, c = _variants(st.logits, st.softmax_node, st)
    used = set().union(*(e and {n.value for n in walk(e) if n.op is ExprOp.LOAD} or set() for e in (score, mask, st.sink)))
    aux = {k: v for k, v in st.aux.items() if k in used}
    return TracedAttention(score, mask, st.q.scale * st.k.scale * c, st.q.name, st.k.name, st.v.name,
                           st.k.rep, aux, out_dtype=_output_dtype(gm),
                           state={k: v for k, v in st.state.items() if k in used}, baked=frozenset(st.baked),
                           derived={k: v for k, v in st.derived.items() if k in used}, gathers=dict(st.gathers),
                           packed=frozenset(st.packed), sink=st.sink, token_seq=st.token_seq)


def _gathered_inputs(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Placeholders indexed as `cache[table]` by an integer placeholder (a paged KV cache or a token pool)."""
    found = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or _packet(n) != "index" or not isinstance(n.args[0], torch.fx.Node):
            continue
        ix = n.args[1]
        if n.args[0].op == "placeholder" and len(ix) == 1 and isinstance(ix[0], torch.fx.Node) \
                and ix[0].op == "placeholder" and not _dtype_of(ix[0]).is_floating_point:
            found.add(n.args[0])
    return found


def _input_labels(dim: int, gathered: bool) -> tuple[str, ...]:
    """Dim labels of an attention input: [B, H, S, D]; a gathered cache [NUM_PAGES, PAGE, H, D] or pool
    [POOL, H, D]; 'x' is the first dim of another 3-D input, batch or packed tokens (see `_resolved`)."""
    if gathered and dim in (3, 4):
        return ("page", "s", "h", "d") if dim == 4 else ("tok", "h", "d")
    if dim == 4:
        return ("b", "h", "s", "d")
    return ("x", "h", "d") if dim == 3 else tuple("?" * dim)


def _output_dtype(gm: torch.fx.GraphModule) -> torch.dtype:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    val = out.meta.get("val") if isinstance(out, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


def trace_mod(
    fn: Callable[..., Any],
    params: Sequence[str],
    name_of: NameOf,
    source: str | None = None,
    boolean: bool = False,
) -> tuple[Expr, dict[str, torch.Tensor]]:
    """Trace a FlexAttention-style mod: each parameter is a 0-dim tensor standing for the variable of the
    same name (score: fp32, indices: int32), as FlexAttention's vmap passes them, so indexing a table by
    them drops its dim (`intervals[i][0]`). Returns (expr, aux)."""
    inputs = [torch.zeros((), dtype=torch.float32 if p == "score" else torch.int32) for p in params]
    with TensorIndexing():
        gm = _record(fn, inputs, f"{getattr(fn, '__name__', 'mod')}()", source)
    st = _State(names={}, name_of=name_of, source=source)
    env: dict[torch.fx.Node, Any] = {}
    for node, p, x in zip([n for n in gm.graph.nodes if n.op == "placeholder"], params, inputs):
        env[node] = Sym((), var(p), x.dtype)
    out = _run(gm, env, st)
    if not isinstance(out, Sym):
        raise KBError(f"{getattr(fn, '__name__', 'mod')}() must return a tensor computed from its arguments")
    if out.shape not in ((), (1,)):
        raise KBError(f"{getattr(fn, '__name__', 'mod')}() returns shape {out.shape}; it must be elementwise")
    e = substitute(out.expr, {"_d0": const(0)})
    if boolean and not out.is_bool:
        e = e.ne(0)

    e = simplify(e)
    used = {str(n.value) for n in walk(e) if n.op is ExprOp.LOAD}
    return e, {k: v for k, v in st.aux.items() if k in used}
