"""Load an attention spec file and trace it into features and IR variant expressions.

Two spec styles (docs/specs.md), also combined in one file:
- KernelBench: `Model(nn.Module)`, `get_inputs()`, `get_init_inputs()`; `forward(q, k, v, *extra)`
  with q, k `[B, H, S, D]` and v `[B, H, S, Dv]` (Dv = D, or MLA-style value heads). Traced with torch.fx (generate.spec_trace).
- FlexAttention: module-level `score_mod(score, b, h, q_idx, kv_idx)` and/or
  `mask_mod(b, h, q_idx, kv_idx)` plus `SHAPES = dict(B=, Hq=, Hkv=, M=, N=, D=, dtype=)` (`Dv=` when
  the value head dim differs from D).
  When a file has both, the mods define the variant expressions and `Model` the reference
  and the shapes.
- Serving (KernelBench style): paged-KV decode `forward(q, k_cache, v_cache, block_table, seq_lens)` and
  packed varlen `forward(q, k, v, cu_seqlens)`; `Spec.layout` names the layout, and shapes, aux and
  reference are the dense view (generate.spec_serving).

Invariants of a `Spec`: `reference(q, k, v)` is the spec's own computation (the user's Model,
or a dense torch evaluation of the user's mods, fully masked rows -> 0), never our IR;
`aux` holds every tensor the expressions load, under the names they load it by. Parameters and
persistent buffers of the Model are never folded into constants: they are aux tensors the kernel
reads at run time (`state` says which state_dict entry each one is), except buffers whose values
equal an index expression (tril/band masks), which `state` marks as baked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import math
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from generate.spec_serving import ServingLayout, dense_shapes, feature_mask, layout_of, serving_reference
from generate.spec_trace import NameOf, aux_name, trace_attention, trace_mod
from kb.errors import KBError
from kb.features import Features
from kb.ir.classify import features_from_variants
from kb.ir.evaluate import dense_scores_mask
from kb.ir.expr import Expr, print_expr
from verify.flex import dense_attention, parse_shapes

__all__ = ["SpecKind", "Shapes", "StateTensor", "Spec", "load_spec", "import_spec_file", "spec_inputs", "dense_reference",
           "variants_attention", "DTYPES"]

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SCORE_PARAMS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_PARAMS = ("b", "h", "q_idx", "kv_idx")

Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SpecKind(Enum):
    KERNELBENCH = "kernelbench"
    FLEX = "flex"
    BOTH = "both"  # mods define the variants, Model the reference


@dataclass(frozen=True)
class Shapes:
    B: int
    Hq: int
    Hkv: int
    M: int  # seq_q
    N: int  # seq_kv
    D: int  # q and k's head dim
    dtype: str  # one of DTYPES
    Dv: int = 0  # v's (and the output's) head dim; 0 = D

    def __post_init__(self) -> None:
        if not self.Dv:
            object.__setattr__(self, "Dv", self.D)

    @property
    def value_dim(self) -> bool:
        """Does v have a head dim of its own (D_v != D_qk)?"""
        return self.Dv != self.D

    @property
    def gqa_ratio(self) -> int:
        return self.Hq // self.Hkv

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class StateTensor:
    """One entry of the spec Model's state_dict, as a candidate must hold it so that
    `ModelNew.load_state_dict(Model.state_dict())` works and a new value takes effect."""

    key: str  # the state_dict key, e.g. "attn.rel_bias"
    parameter: bool  # an nn.Parameter (else a buffer)
    aux: str | None  # the aux tensor the kernel reads it as (a 0-dim one as `aux[0]` of shape [1]); None: not read
    baked: bool = False  # a buffer the kernel holds as the index expression its value equals (tril/band masks)


@dataclass(frozen=True)
class Spec:
    path: Path
    kind: SpecKind
    score_mod: Expr | None
    mask_mod: Expr | None
    aux: Mapping[str, torch.Tensor] = field(repr=False, compare=False)
    shapes: Shapes
    scale: float | None  # None = 1/sqrt(D)
    features: Features
    source_hash: str
    reference: Reference = field(repr=False, compare=False)
    # the call a candidate must accept: Model.forward's parameter names, which of them are q, k, v,
    # and Model.__init__'s parameter names (empty for FlexAttention-style specs: forward(q, k, v))
    forward_names: tuple[str, ...] = ("q", "k", "v")
    qkv_names: tuple[str, str, str] = ("q", "k", "v")
    init_params: tuple[str, ...] = ()
    out_dtype: str | None = None  # what the spec returns (one of DTYPES); None = the input dtype
    state: tuple[StateTensor, ...] = ()  # the Model's state_dict entries (none for FlexAttention-style specs)
    state_values: Mapping[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)  # key -> value
    heads_fixed: int | None = None  # Hq the variant expressions were traced for, when they change with the head count
    init_fixed: tuple[tuple[int, str, object], ...] = ()
    # aux tensors the candidate computes from a forward input before the launch (torch.searchsorted ids):
    # aux name -> (forward input name, right)
    derived_aux: Mapping[str, tuple[str, bool]] = field(default_factory=dict)  # (position, name, value) of constructor args baked in the kernel
    # a paged-KV or packed varlen spec (generate.spec_serving): shapes, aux and reference are its dense view
    layout: ServingLayout | None = None

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.shapes.D) if self.scale is None else self.scale

    @property
    def output_dtype(self) -> str:
        return self.out_dtype or self.shapes.dtype

    def variant_strings(self) -> tuple[str | None, str | None]:
        """(score_mod, mask_mod) bodies as IR expression text; None where the spec has none."""
        return (print_expr(self.score_mod) if self.score_mod is not None else None,
                print_expr(self.mask_mod) if self.mask_mod is not None else None)

    def variants_text(self) -> str:
        """The variant slots in IR text form."""
        score, mask = self.variant_strings()
        lines = []
        if score is not None:
            lines.append(f"score_mod(score, b, h, q_idx, kv_idx) = {score}")
        if mask is not None:
            lines.append(f"mask_mod(b, h, q_idx, kv_idx) = {mask}")
        return "\n".join(lines)


# ---------------------------------------------------------------- loading


def import_spec_file(path: Path) -> Any:
    """The spec file imported as a module (not kept in sys.modules); KBError when it cannot be."""
    if not path.is_file():
        raise KBError(f"spec file {path} does not exist")
    name = "kb_spec_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise KBError(f"cannot import spec file {path}: not a Python file")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - the user's file failed to import
        raise KBError(f"cannot import spec file {path}: {type(err).__name__}: {err}") from None
    finally:
        sys.modules.pop(name, None)
    return module


def _tensor_namer(named: list[tuple[str, torch.Tensor]]) -> NameOf:
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


def _module_tensors(module: Any) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor) and not k.startswith("__")]


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
        return trace_attention(model, inputs, names, _tensor_namer(_model_tensors(model)), str(path.resolve()), kinds)
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
    if q.dtype not in _DTYPE_NAMES:
        raise KBError(f"{path}: unsupported dtype {q.dtype}; use one of {', '.join(DTYPES)}")
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise KBError(f"{path}: {Hq} query heads are not a multiple of {Hkv} kv heads")
    _check_values(k, v, path)
    return Shapes(B, Hq, Hkv, M, N, D, _DTYPE_NAMES[q.dtype], v.shape[3])


def _serving_shapes(layout: ServingLayout, inputs: Mapping[str, torch.Tensor], path: Path) -> Shapes:
    """The dense view's shapes (generate.spec_serving.dense_shapes), checked like a dense spec's."""
    B, Hq, Hkv, M, N, D, Dv = dense_shapes(layout, inputs)
    q = inputs[layout.q]
    if q.dtype not in _DTYPE_NAMES:
        raise KBError(f"{path}: unsupported dtype {q.dtype}; use one of {', '.join(DTYPES)}")
    if Hq % Hkv:
        raise KBError(f"{path}: {Hq} query heads are not a multiple of {Hkv} kv heads")
    return Shapes(B, Hq, Hkv, M, N, D, _DTYPE_NAMES[q.dtype], Dv)


def _shapes_from_dict(d: Any, path: Path) -> Shapes:
    try:
        f = parse_shapes(d)
    except ValueError as err:
        raise KBError(f"{path}: {err}") from None
    return Shapes(f.B, f.Hq, f.Hkv, f.M, f.N, f.D, f.dtype, f.Dv)


def _scale_or_none(scale: float, D: int) -> float | None:
    return None if math.isclose(scale, 1.0 / math.sqrt(D), rel_tol=1e-6) else scale


def load_spec(path: str | Path) -> Spec:
    """Load and trace a spec file (see module docstring); raises KBError on anything unsupported."""
    path = Path(path)
    text = path.read_text() if path.is_file() else ""
    module = import_spec_file(path)
    source_hash = hashlib.sha256(text.encode()).hexdigest()
    has_model = all(hasattr(module, n) for n in ("Model", "get_inputs", "get_init_inputs"))
    mods = {n: getattr(module, n) for n in ("score_mod", "mask_mod") if callable(getattr(module, n, None))}
    if not has_model and not mods:
        raise KBError(f"{path} is not a spec: define Model, get_inputs and get_init_inputs (KernelBench style) "
                      "or score_mod/mask_mod with SHAPES (FlexAttention style)")
    state: tuple[StateTensor, ...] = ()
    state_values: dict[str, torch.Tensor] = {}
    out_dtype: str | None = None
    layout: ServingLayout | None = None
    if has_model:
        model, inputs = _instantiate(module, path)
        names = _forward_names(model, len(inputs))
        kinds = _state_kinds(model)
        traced = _trace_model(model, inputs, names, kinds, path)
        qi, ki, vi = names.index(traced.q), names.index(traced.k), names.index(traced.v)
        layout = layout_of(traced, dict(zip(names, inputs)), path)
        aux, scale = dict(traced.aux), traced.scale
        if layout is None:
            shapes = _shapes_of(inputs[qi], inputs[ki], inputs[vi], path)
            reference = _model_reference(model, inputs, qi, ki, vi)
            score, mask = _generalize_shapes(model, inputs, names, (qi, ki, vi), traced, kinds, path)
            heads_fixed = _heads_fixed(model, inputs, names, (qi, ki, vi), traced, kinds, path)
            init_fixed = _init_fixed(module, inputs, names, traced, kinds, path)
        else:  # traced at the spec's own inputs only: their tables fix the shapes (docs/specs.md, serving specs)
            shapes = _serving_shapes(layout, dict(zip(names, inputs)), path)
            reference = serving_reference(model, inputs, names, layout, path)
            score, mask, heads_fixed, init_fixed = traced.score_mod, traced.mask_mod, None, ()
        out_dtype = _dtype_name(traced.out_dtype, "output", path)
        state, state_values = _state_of(model, kinds, traced.state, traced.baked)
        _check_constants(module, model, set(aux) - set(traced.state) - set(names) - set(traced.derived), path)
        kind = SpecKind.KERNELBENCH
        call = (tuple(names), (traced.q, traced.k, traced.v), _init_names(module.Model))
    if mods:
        name_of = _tensor_namer(_module_tensors(module))
        src = str(path.resolve())
        aux = {}
        score = mask = None
        if "score_mod" in mods:
            score, a = trace_mod(mods["score_mod"], SCORE_PARAMS, name_of, src)
            aux.update(a)
            score = None if print_expr(score) == "score" else score
        if "mask_mod" in mods:
            mask, a = trace_mod(mods["mask_mod"], MASK_PARAMS, name_of, src, boolean=True)
            aux.update(a)
        shapes_dict = getattr(module, "SHAPES", None)
        if not has_model:
            shapes = _shapes_from_dict(shapes_dict, path)
            reference = dense_reference(mods.get("score_mod"), mods.get("mask_mod"), _flex_scale(shapes_dict, shapes))
        scale = _flex_scale(shapes_dict if isinstance(shapes_dict, Mapping) else {}, shapes)
        kind = SpecKind.BOTH if has_model else SpecKind.FLEX
    features = features_from_variants(
        score, mask if layout is None else feature_mask(mask, layout, traced.derived), head_dim=shapes.D,
        dtype=shapes.dtype, gqa_ratio=shapes.gqa_ratio, seq_q=shapes.M, seq_kv=shapes.N,
        paged_kv=layout is not None and layout.kind != "varlen", varlen=layout is not None and layout.kind == "varlen",
    )
    log.info("spec %s: %s", path, features.describe())
    call = call if has_model else (("q", "k", "v"), ("q", "k", "v"), ())
    spec = Spec(path, kind, score, mask, aux, shapes, _scale_or_none(scale, shapes.D), features, source_hash, reference,
                *call, out_dtype=out_dtype, state=state, state_values=state_values,
                heads_fixed=heads_fixed if has_model else None, init_fixed=init_fixed if has_model else (),
                derived_aux=dict(traced.derived) if has_model else {}, layout=layout)
    _self_check(spec)
    return spec


# gross-error bound of the self check (the IR check and verify do the precise work)
_SELF_CHECK_TOL = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 5e-2}


def _self_check(spec: Spec) -> None:
    """The attention read off the spec must be what the spec computes; otherwise tracing missed a
    construct, and every kernel would fail for the spec's reason (which is not a lesson about kernels)."""
    q, k, v = spec_inputs(spec, seed=1)
    with torch.no_grad():
        ref = spec.reference(q, k, v).float()
        got = variants_attention(spec, q, k, v).float()
    if ref.shape != got.shape:
        raise KBError(f"{spec.path}: the spec returns shape {tuple(ref.shape)}, attention over its q, k, v gives "
                      f"{tuple(got.shape)} ([B, Hq, M, Dv])")
    defined = ~torch.isnan(ref)  # rows the spec leaves undefined (fully masked, softmax of -inf)
    err = float((ref - got).abs()[defined].max()) if bool(defined.any()) else 0.0
    tol = _SELF_CHECK_TOL[spec.shapes.dtype] * max(1.0, float(ref[defined].abs().max()) if bool(defined.any()) else 1.0)
    if not err <= tol:
        text = spec.variants_text() or "plain softmax(q @ k^T * scale) @ v"
        raise KBError(f"{spec.path}: what tracing read off the spec ({text}; scale {spec.softmax_scale:.6g}) differs from "
                      f"what the spec computes (max abs err {err:.3g}): it uses a construct tracing does not capture",
                      hint="see docs/specs.md for the supported attention patterns")


def _dtype_name(dtype: torch.dtype, what: str, path: Path) -> str:
    if dtype not in _DTYPE_NAMES:
        raise KBError(f"{path}: the spec's {what} dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    return _DTYPE_NAMES[dtype]


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
    except Exception:  # noqa: BLE001 - it constructed once with seed 0; nothing to compare
        return
    first, second = dict(_model_tensors(model)), dict(_model_tensors(again))
    random = sorted(k for k, t in first.items() if aux_name(k) in names and k in second
                    and (t.shape != second[k].shape or not torch.equal(t, second[k])))
    if random:
        raise KBError(f"{path}: Model tensor(s) {', '.join(random)} take a new random value in every "
                      "Model(*get_init_inputs()) but are not in its state_dict, so a kernel cannot receive them; "
                      "make them nn.Parameter or persistent buffers (register_buffer(name, t))")


def _generalize_shapes(model: torch.nn.Module, inputs: list[Any], names: list[str], qkv: tuple[int, int, int],
                       traced: Any, kinds: Mapping[str, str], path: Path) -> tuple[Expr | None, Expr | None]:
    """Variant expressions with shape-derived constants written in M and N (see spec_generalize)."""
    from generate.spec_generalize import DELTA, generalize

    qi, ki, vi = qkv
    q, k = inputs[qi], inputs[ki]
    m, n = q.shape[2], k.shape[2]
    for dm, dn in (DELTA, (DELTA[0], DELTA[0])):
        args = list(inputs)
        args[qi] = torch.randn(*q.shape[:2], m + dm, q.shape[3], dtype=q.dtype)
        args[ki] = torch.randn(*k.shape[:2], n + dn, k.shape[3], dtype=k.dtype)
        args[vi] = torch.randn(*inputs[vi].shape[:2], n + dn, inputs[vi].shape[3], dtype=inputs[vi].dtype)
        try:
            again = trace_attention(model, args, names, _tensor_namer(_model_tensors(model)), str(path.resolve()), kinds)
        except Exception:  # noqa: BLE001 - the spec only works at its own shapes (or M == N): try the next delta
            continue
        dims1, dims2 = (m, n), (m + dm, n + dn)
        return (generalize(traced.score_mod, again.score_mod, dims1, dims2),
                generalize(traced.mask_mod, again.mask_mod, dims1, dims2))
    log.info("%s: variant constants kept as traced (the spec does not run at other sequence lengths)", path)
    return traced.score_mod, traced.mask_mod


def _same_variants(a: Any, b: Any) -> bool:
    """Two traces of a spec read the same score_mod and mask_mod."""
    return all((x is None) == (y is None) and (x is None or print_expr(x) == print_expr(y))
               for x, y in ((a.score_mod, b.score_mod), (a.mask_mod, b.mask_mod)))


def _heads_fixed(model: torch.nn.Module, inputs: list[Any], names: list[str], qkv: tuple[int, int, int],
                 traced: Any, kinds: Mapping[str, str], path: Path) -> int | None:
    """The spec's Hq if its variant expressions change with the head count (constants computed from
    q.shape[1] in forward, such as ALiBi slopes built there): traced again with twice the heads (same GQA
    ratio), different expressions mean the kernel is right only at this Hq, and the candidate refuses others.
    A spec that does not run at twice the heads says nothing (None)."""
    args = list(inputs)
    for i in qkv:
        t = inputs[i]
        args[i] = torch.randn(t.shape[0], 2 * t.shape[1], *t.shape[2:], dtype=t.dtype)
    try:
        again = trace_attention(model, args, names, _tensor_namer(_model_tensors(model)), str(path.resolve()), kinds)
    except Exception:  # noqa: BLE001 - e.g. a per-head buffer sized for the spec's heads: the kernel reads it at run time
        return None
    return None if _same_variants(traced, again) else int(inputs[qkv[0]].shape[1])


def _init_fixed(module: Any, inputs: list[Any], names: list[str], traced: Any, kinds: Mapping[str, str],
                path: Path) -> tuple[tuple[int, str, object], ...]:
    """Numeric constructor arguments whose value the kernel holds as a constant (a window size, a maximum
    length used as an offset): the Model built with that argument changed must trace to other expressions.
    The candidate's ModelNew then refuses other values with a clear error instead of computing the old ones."""
    args = list(module.get_init_inputs())
    params = [p for p in list(inspect.signature(module.Model.__init__).parameters.values())[1:]
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    fixed = []
    for i, (value, param) in enumerate(zip(args, params)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        changed = list(args)
        changed[i] = value + 1 if isinstance(value, int) else value * 1.5 + 1.0
        try:
            torch.manual_seed(0)
            other = module.Model(*changed).eval()
            again = trace_attention(other, inputs, names, _tensor_namer(_model_tensors(other)), str(path.resolve()), kinds)
        except Exception:  # noqa: BLE001 - the Model does not build or run with that value: nothing to say
            continue
        if not _same_variants(traced, again):
            fixed.append((i, param.name, value))
    return tuple(fixed)


def _init_names(cls: type) -> tuple[str, ...]:
    """Model.__init__'s parameters as source text (`n_heads`, `window=64`, `*args`, `**kwargs`), self excluded."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(prefix.get(p.kind, "") + (p.name if p.default is p.empty else f"{p.name}={p.default!r}") for p in params)


def _flex_scale(d: Mapping[str, Any], shapes: Shapes) -> float:
    s = d.get("scale")
    return 1.0 / math.sqrt(shapes.D) if s is None else float(s)


def _instantiate(module: Any, path: Path) -> tuple[torch.nn.Module, list[Any]]:
    try:
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs())
        model.eval()
        inputs = list(module.get_inputs())
    except Exception as err:  # noqa: BLE001 - the user's code failed
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


def dense_reference(score_mod: Callable[..., Any] | None, mask_mod: Callable[..., Any] | None, scale: float) -> Reference:
    """Plain torch attention evaluating the user's mods on broadcast index tensors (int32, as
    FlexAttention passes them); fully masked rows give 0. The same function `kb verify` runs
    as the Model of a FlexAttention-style spec (verify.flex)."""

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_attention(q, k, v, score_mod, mask_mod, scale)

    return reference


def spec_inputs(spec: Spec, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v of the spec's shapes and dtype."""
    g = torch.Generator().manual_seed(seed)
    s = spec.shapes
    dt = s.torch_dtype
    q = torch.randn(s.B, s.Hq, s.M, s.D, generator=g).to(dt)
    k = torch.randn(s.B, s.Hkv, s.N, s.D, generator=g).to(dt)
    v = torch.randn(s.B, s.Hkv, s.N, s.Dv, generator=g).to(dt)
    return q, k, v


def variants_attention(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       aux: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention computed from the spec's *extracted* IR expressions (fp32, dense): the
    independent check of tracing is `variants_attention == spec.reference`. Differentiable in q, k, v
    and in `aux` (the aux tensors the expressions read; default the spec's)."""
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    kk, vv = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = (q.float() @ kk.transpose(-2, -1)) * spec.softmax_scale
    env = {"B": B, "Hq": Hq, "Hkv": Hkv, "H": Hq, "M": M, "N": N, "D": D}
    s, keep = dense_scores_mask(s, spec.score_mod, spec.mask_mod, env, spec.aux if aux is None else aux)
    keep = keep.expand(B, Hq, M, N)
    p = torch.softmax(s.float().masked_fill(~keep, -math.inf), dim=-1)
    p = torch.where(keep.any(-1, keepdim=True), p, torch.zeros((), dtype=p.dtype))
    return (p @ vv).to(q.dtype)
