"""KernelBench-style specs: `Model(nn.Module)`, `get_inputs()`, `get_init_inputs()` (docs/specs.md, style 1).

`load_model(module, path)` builds the Model (seed 0, eval mode), traces its forward with torch.fx
(generate.spec_trace) and reads off what a `Spec` takes from it: the variant expressions (shape-derived
constants written in M and N), shapes, the Model as the reference, the call a candidate must accept,
and the Model's state. Serving specs (paged-KV decode, packed varlen) are read as their dense view
(generate.spec_serving).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from generate.spec_generalize import DELTA, generalize, generalize_heads, generalize_sizes
from generate.spec_serving import ServingLayout, dense_shapes, layout_of, serving_reference, visible_keys
from generate.spec_trace import aux_name, tensor_namer, trace_attention
from generate.spec_types import DTYPE_NAMES, DTYPES, Reference, Shapes, StateTensor
from kb.errors import KBError
from kb.ir.expr import Expr, ExprOp, print_expr, walk

__all__ = ["ModelSpec", "load_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What a KernelBench-style spec's Model gives a `Spec` (see its fields)."""

    score_mod: Expr | None
    mask_mod: Expr | None
    aux: dict[str, torch.Tensor]
    scale: float
    shapes: Shapes
    reference: Reference
    forward_names: tuple[str, ...]
    qkv_names: tuple[str, str, str]
    init_params: tuple[str, ...]
    out_dtype: str
    state: tuple[StateTensor, ...]
    state_values: dict[str, torch.Tensor]
    heads_fixed: int | None
    init_fixed: tuple[tuple[int, str, object], ...]
    lengths_fixed: tuple[int, int] | None
    derived_aux: dict[str, tuple[str, bool]]
    layout: ServingLayout | None
    sink: Expr | None  # an attention sink's logit in (b, h), e.g. sinks[h]


def load_model(module: Any, path: Path) -> ModelSpec:
    """Build, trace and read the spec's Model; KBError on anything unsupported."""
    model, inputs = _instantiate(module, path)
    names = _forward_names(model, len(inputs))
    kinds = _state_kinds(model)
    traced = _trace_model(model, inputs, names, kinds, path)
    qi, ki, vi = names.index(traced.q), names.index(traced.k), names.index(traced.v)
    layout = layout_of(traced, dict(zip(names, inputs)), path)
    heads_fixed: int | None = None
    init_fixed: tuple[tuple[int, str, object], ...] = ()
    lengths_fixed: tuple[int, int] | None = None
    if layout is None:
        shapes = _shapes_of(inputs[qi], inputs[ki], inputs[vi], path)
        reference = _model_reference(model, inputs, qi, ki, vi)
        score, mask, lengths_fixed = _generalize_shapes(model, inputs, names, (qi, ki, vi), traced, kinds, path)
        score, mask, heads_fixed = _generalize_heads(model, inputs, names, (qi, ki, vi), traced, kinds, path, score, mask)
        score, mask, init_fixed = _generalize_init(module, inputs, names, (qi, ki, vi), traced, kinds, path, score, mask)
    else:  # traced at the spec's own inputs only: their tables fix the shapes (docs/specs.md, serving specs)
        named = dict(zip(names, inputs))
        shapes = _serving_shapes(layout, named, path)
        visible = visible_keys(layout, named, traced.mask_mod, traced.aux) if layout.kind != "varlen" else None
        reference = serving_reference(model, inputs, names, layout, path, visible)
        score, mask = traced.score_mod, traced.mask_mod
    out_dtype = _dtype_name(traced.out_dtype, "output", path)
    state, state_values = _state_of(model, kinds, traced.state, traced.baked)
    aux = dict(traced.aux)
    _check_constants(module, model, set(aux) - set(traced.state) - set(names) - set(traced.derived), path)
    return ModelSpec(score, mask, aux, traced.scale, shapes, reference, tuple(names), (traced.q, traced.k, traced.v),
                     _init_names(module.Model), out_dtype, state, state_values, heads_fixed, init_fixed,
                     lengths_fixed, dict(traced.derived), layout, traced.sink)


def _model_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [(n, b) for n, b in model.named_buffers()] + [(n, p) for n, p in model.named_parameters()]
    for mod_name, sub in model.named_modules():
        for k, v in vars(sub).items():
            if isinstance(v, torch.Tensor) and not k.startswith("_"):
                named.append((f"{mod_name}.{k}" if mod_name else k, v))
    return named


def _forward_names(model: torch.nn.Module, n: int) -> list[str]:
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in params][:n]
    return names + [f"arg{i}" for i in range(len(names), n)]


def _trace_model(model: torch.nn.Module, inputs: list[Any], names: list[str], kinds: Mapping[str, str], path: Path) -> Any:
    """The traced attention of the spec's Model; a failure that k and v's shapes explain says so instead."""
    try:
        return trace_attention(model, inputs, names, tensor_namer(_model_tensors(model)), str(path.resolve()), kinds)
    except KBError:
        qkv = [x for x in inputs if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point()][:3]
        if len(qkv) == 3:
            _check_values(qkv[1], qkv[2], path)
        raise


def _check_values(k: torch.Tensor, v: torch.Tensor, path: Path) -> None:
    """v must have k's batch, heads and length; only its head dim may differ (D_v != D_qk)."""
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise KBError(f"{path}: v {tuple(v.shape)} must match k {tuple(k.shape)} in batch, heads and length "
                      "(only the head dim may differ)")


def _shapes_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, path: Path) -> Shapes:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise KBError(f"{path}: q, k and v must be [B, H, S, D], got {tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    if q.dtype not in DTYPE_NAMES:
        raise KBError(f"{path}: unsupported dtype {q.dtype}; use one of {', '.join(DTYPES)}")
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise KBError(f"{path}: {Hq} query heads are not a multiple of {Hkv} kv heads")
    _check_values(k, v, path)
    return Shapes(B, Hq, Hkv, M, N, D, DTYPE_NAMES[q.dtype], v.shape[3])


def _serving_shapes(layout: ServingLayout, inputs: Mapping[str, torch.Tensor], path: Path) -> Shapes:
    """The dense view's shapes (generate.spec_serving.dense_shapes), checked like a dense spec's."""
    B, Hq, Hkv, M, N, D, Dv = dense_shapes(layout, inputs)
    q = inputs[layout.q]
    if q.dtype not in DTYPE_NAMES:
        raise KBError(f"{path}: unsupported dtype {q.dtype}; use one of {', '.join(DTYPES)}")
    if Hq % Hkv:
        raise KBError(f"{path}: {Hq} query heads are not a multiple of {Hkv} kv heads")
    return Shapes(B, Hq, Hkv, M, N, D, DTYPE_NAMES[q.dtype], Dv)


def _dtype_name(dtype: torch.dtype, what: str, path: Path) -> str:
    if dtype not in DTYPE_NAMES:
        raise KBError(f"{path}: the spec's {what} dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPE_NAMES[dtype]


def _state_kinds(model: torch.nn.Module) -> dict[str, str]:
    """state_dict key -> "parameter" | "buffer" (persistent buffers only: the others are not state)."""
    params = {n for n, _ in model.named_parameters()}
    return {k: "parameter" if k in params else "buffer" for k in model.state_dict()}


def _state_of(model: torch.nn.Module, kinds: Mapping[str, str], read: Mapping[str, str],
              baked: frozenset[str]) -> tuple[tuple[StateTensor, ...], dict[str, torch.Tensor]]:
    """Every state_dict entry with how the kernel uses it; `read` maps aux names to the keys they read."""
    aux_of = {key: name for name, key in read.items()}
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    entries = tuple(StateTensor(k, kinds[k] == "parameter", aux_of.get(k), k in baked and k not in aux_of)
                    for k in values)
    return entries, values


def _check_constants(module: Any, model: torch.nn.Module, names: set[str], path: Path) -> None:
    """Refuse tensors the kernel would hold as constants although every Model(*get_init_inputs())
    draws them anew (plain tensor attributes or non-persistent buffers with random values): the
    kernel keeps the generation-time value, the Model another one, and no state_dict carries it."""
    if not names:
        return
    torch.manual_seed(1)
    try:
        again = module.Model(*module.get_init_inputs())
    except Exception:
        return
    first, second = dict(_model_tensors(model)), dict(_model_tensors(again))
    random = sorted(k for k, t in first.items() if aux_name(k) in names and k in second
                    and (t.shape != second[k].shape or not torch.equal(t, second[k])))
    if random:
        raise KBError(f"{path}: Model tensor(s) {', '.join(random)} take a new random value in every "
                      "Model(*get_init_inputs()) but are not in its state_dict, so a kernel cannot receive them; "
                      "make them nn.Parameter or persistent buffers (register_buffer(name, t))")


def _generalize_shapes(model: torch.nn.Module, inputs: list[Any], names: list[str], qkv: tuple[int, int, int],
                       traced: Any, kinds: Mapping[str, str],
                       path: Path) -> tuple[Expr | None, Expr | None, tuple[int, int] | None]:
    """(score_mod, mask_mod) with shape-derived constants written in M and N (see spec_generalize), and the (M, N)
    the kernel is right only at: when the spec runs at no other lengths, an integer constant of its expressions
    (the `n - 1` of a table sized by a constructor argument) may come from the lengths, and nothing tells."""
    qi, ki, vi = qkv
    q, k = inputs[qi], inputs[ki]
    m, n = q.shape[2], k.shape[2]
    # longer first; then shorter, for a buffer sized to the spec's own lengths and sliced to the inputs'
    for dm, dn in (DELTA, (DELTA[0], DELTA[0]), (-DELTA[0], -DELTA[1]), (-DELTA[0], -DELTA[0])):
        args = list(inputs)
        args[qi] = torch.randn(*q.shape[:2], m + dm, q.shape[3], dtype=q.dtype)
        args[ki] = torch.randn(*k.shape[:2], n + dn, k.shape[3], dtype=k.dtype)
        args[vi] = torch.randn(*inputs[vi].shape[:2], n + dn, inputs[vi].shape[3], dtype=inputs[vi].dtype)
        try:
            again = trace_attention(model, args, names, tensor_namer(_model_tensors(model)), str(path.resolve()), kinds)
        except Exception:
            continue
        dims1, dims2 = (m, n), (m + dm, n + dn)
        return (generalize(traced.score_mod, again.score_mod, dims1, dims2),
                generalize(traced.mask_mod, again.mask_mod, dims1, dims2), None)
    exprs = [e for e in (traced.score_mod, traced.mask_mod) if e is not None]
    if not any(_int_constant(c) for e in exprs for c in walk(e)):
        return traced.score_mod, traced.mask_mod, None
    log.info("%s: variant constants kept as traced; the kernel holds M=%d, N=%d (the spec runs at no other "
             "sequence lengths)", path, m, n)
    return traced.score_mod, traced.mask_mod, (m, n)


def _int_constant(e: Expr) -> bool:
    """An integer constant other than 0 and +-1 (those come from index arithmetic, not from a length)."""
    return (e.op is ExprOp.CONST and isinstance(e.value, int) and not isinstance(e.value, bool)
            and abs(e.value) > 1)


def _same_variants(a: Any, b: Any) -> bool:
    """Two traces of a spec read the same score_mod and mask_mod."""
    return all((x is None) == (y is None) and (x is None or print_expr(x) == print_expr(y))
               for x, y in ((a.score_mod, b.score_mod), (a.mask_mod, b.mask_mod)))


def _generalize_heads(model: torch.nn.Module, inputs: list[Any], names: list[str], qkv: tuple[int, int, int],
                      traced: Any, kinds: Mapping[str, str], path: Path, score: Expr | None,
                      mask: Expr | None) -> tuple[Expr | None, Expr | None, int | None]:
    """(score_mod, mask_mod, heads_fixed): `score` and `mask` (traced, lengths generalized) with constants computed
    from the head count in forward (ALiBi slopes built from q.shape[1]) written in Hq / Hkv, so the kernel is right
    at every head count. Traced again with twice and three times the heads (same GQA ratio): the expressions must
    differ only in such constants, and both traces must give the same generalization (a rule that is not one,
    like BLOOM's nearest power of two, fails it). Otherwise heads_fixed is the spec's Hq, and the candidate refuses
    others. A spec that does not run at other head counts says nothing (None)."""
    heads = (int(inputs[qkv[0]].shape[1]), int(inputs[qkv[1]].shape[1]))
    found: list[tuple[Expr | None, Expr | None]] = []
    for factor in (2, 3):
        args = list(inputs)
        for i in qkv:
            t = inputs[i]
            args[i] = torch.randn(t.shape[0], factor * t.shape[1], *t.shape[2:], dtype=t.dtype)
        try:
            again = trace_attention(model, args, names, tensor_namer(_model_tensors(model)), str(path.resolve()), kinds)
        except Exception:
            return score, mask, None
        if factor == 2 and _same_variants(traced, again):
            return score, mask, None
        score2, mask2, _ = _generalize_shapes(model, args, names, qkv, again, kinds, path)
        other = (factor * heads[0], factor * heads[1])
        (ok_s, s), (ok_m, m) = generalize_heads(score, score2, heads, other), generalize_heads(mask, mask2, heads, other)
        if not (ok_s and ok_m):
            return score, mask, heads[0]
        found.append((s, m))
    if found[0] != found[1]:
        return score, mask, heads[0]
    log.info("%s: variant constants computed from the head count written in Hq/Hkv: %s", path,
             "; ".join(print_expr(e) for e in found[0] if e is not None))
    return (*found[0], None)


def _generalize_init(module: Any, inputs: list[Any], names: list[str], qkv: tuple[int, int, int], traced: Any,
                     kinds: Mapping[str, str], path: Path, score: Expr | None,
                     mask: Expr | None) -> tuple[Expr | None, Expr | None, tuple[tuple[int, str, object], ...]]:
    """(score_mod, mask_mod, init_fixed) for numeric constructor arguments that change the traced expressions (a
    window size, the max_len of a relative-position table): where the change is that of a table the argument
    sizes (`pos_bias[h, q_idx - kv_idx + (pos_bias_n1 - 1) // 2]`, `_sized_by`), the expressions read it from the
    table the kernel is given; otherwise the kernel holds the argument's value as a constant (init_fixed) and the
    candidate's ModelNew refuses other values with a clear error instead of computing the old ones."""
    args = list(module.get_init_inputs())
    params = [p for p in list(inspect.signature(module.Model.__init__).parameters.values())[1:]
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    fixed = []
    for i, (value, param) in enumerate(zip(args, params)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        first = _changed_trace(module, args, i, value + 1 if isinstance(value, int) else value * 1.5 + 1.0, inputs,
                               names, kinds, path)
        if first is None or _same_variants(traced, first[1]):
            continue
        general = _sized_by(module, args, i, first, inputs, names, qkv, traced, kinds, path, score, mask) \
            if isinstance(value, int) else None
        if general is None:
            fixed.append((i, param.name, value))
            continue
        score, mask = general
        log.info("%s: constructor argument %s sizes a table; the variant reads the table's size: %s", path,
                 param.name, "; ".join(print_expr(e) for e in general if e is not None))
    return score, mask, tuple(fixed)


def _changed_trace(module: Any, args: list[Any], i: int, value: object, inputs: list[Any], names: list[str],
                   kinds: Mapping[str, str], path: Path) -> tuple[torch.nn.Module, Any] | None:
    """(Model, trace) with constructor argument i set to `value`; None where the Model does not build or run."""
    changed = list(args)
    changed[i] = value
    try:
        torch.manual_seed(0)
        other = module.Model(*changed).eval()
        return other, trace_attention(other, inputs, names, tensor_namer(_model_tensors(other)), str(path.resolve()), kinds)
    except Exception:
        return None


def _sized_by(module: Any, args: list[Any], i: int, first: tuple[torch.nn.Module, Any], inputs: list[Any],
              names: list[str], qkv: tuple[int, int, int], traced: Any, kinds: Mapping[str, str], path: Path,
              score: Expr | None, mask: Expr | None) -> tuple[Expr | None, Expr | None] | None:
    """(score_mod, mask_mod) with the constants that integer argument i moves written in the sizes of the tables it
    sizes (generalize_sizes), when the traces with the argument +1 and +2 (lengths and heads generalized alike)
    give the same expressions; else None."""
    found: list[tuple[Expr | None, Expr | None]] = []
    for step in (1, 2):
        got = first if step == 1 else _changed_trace(module, args, i, args[i] + 2, inputs, names, kinds, path)
        if got is None:
            return None
        other, again = got
        s2, m2, _ = _generalize_shapes(other, inputs, names, qkv, again, kinds, path)
        s2, m2, _ = _generalize_heads(other, inputs, names, qkv, again, kinds, path, s2, m2)
        sizes1, sizes2 = _table_sizes(traced.aux), _table_sizes(again.aux)
        (ok_s, gs), (ok_m, gm) = generalize_sizes(score, s2, sizes1, sizes2), generalize_sizes(mask, m2, sizes1, sizes2)
        if not (ok_s and ok_m) or (gs, gm) == (score, mask):
            return None
        found.append((gs, gm))
    return found[0] if found[0] == found[1] else None


def _table_sizes(aux: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each aux table's dims, named as generate.target names a position no index variable implies."""
    return {f"{n}_n{i}": int(size) for n, t in aux.items() for i, size in enumerate(t.shape)}


def _init_names(cls: type[torch.nn.Module]) -> tuple[str, ...]:
    """Model.__init__'s parameters as source text (`n_heads`, `window=64`, `*args`, `**kwargs`), self excluded."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    prefix = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}
    return tuple(prefix.get(p.kind.name, "") + (p.name if p.default is p.empty else f"{p.name}={p.default!r}") for p in params)


def _instantiate(module: Any, path: Path) -> tuple[torch.nn.Module, list[Any]]:
    try:
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs())
        model.eval()
        inputs = list(module.get_inputs())
    except Exception as err:
        raise KBError(f"{path}: building Model(*get_init_inputs()) / get_inputs() failed: {type(err).__name__}: {err}") from None
    if not isinstance(model, torch.nn.Module):
        raise KBError(f"{path}: Model is not a torch.nn.Module")
    return model, inputs


def _model_reference(model: torch.nn.Module, inputs: list[Any], qi: int, ki: int, vi: int) -> Reference:
    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        args = list(inputs)
        args[qi], args[ki], args[vi] = q, k, v
        with torch.no_grad():
            return model(*args)

    return reference
