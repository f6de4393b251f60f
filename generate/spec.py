"""Load an attention spec file and trace it into features and IR variant expressions.

Two spec styles (docs/specs.md), also combined in one file, each read by its own loader:
- KernelBench (generate.spec_kernelbench): `Model(nn.Module)`, `get_inputs()`, `get_init_inputs()`;
  `forward(q, k, v, *extra)` with q, k `[B, H, S, D]` and v `[B, H, S, Dv]` (Dv = D, or MLA-style value
  heads). Traced with torch.fx (generate.spec_trace).
- FlexAttention (generate.spec_flex): module-level `score_mod(score, b, h, q_idx, kv_idx)` and/or
  `mask_mod(b, h, q_idx, kv_idx)` plus `SHAPES = dict(B=, Hq=, Hkv=, M=, N=, D=, dtype=)` (`Dv=` when
  the value head dim differs from D).
  When a file has both, the mods define the variant expressions and `Model` the reference
  and the shapes.
- Serving (KernelBench style): paged-KV decode `forward(q, k_cache, v_cache, block_table, seq_lens)`,
  packed varlen `forward(q, k, v, cu_seqlens)` (or vLLM's `cu_seqlens_q, cu_seqlens_k, max_seqlen`) and
  chunked prefill against a paged cache; `Spec.layout` names the layout, and shapes, aux and reference are
  the dense view (generate.spec_serving).
- Attention sinks (gpt-oss): `torch.cat([scores, sink], -1).softmax(-1)[..., :-1]`; `Spec.sink` is the sink
  logit in (b, h), which a kernel starts its online softmax at (m = sink, l = 1; docs/ir.md).

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
import logging
import math
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import torch

from generate.spec_flex import FlexMods, trace_mods
from generate.spec_kernelbench import ModelSpec, load_model
from generate.spec_serving import ServingLayout, feature_mask, one_sequence
from generate.spec_types import DTYPE_NAMES, DTYPES, Reference, Shapes, StateTensor
from kb.errors import KBError
from kb.features import Features
from kb.ir.classify import features_from_variants
from kb.ir.evaluate import dense_scores_mask
from kb.ir.expr import Expr, ExprOp, print_expr, var

# Shapes, StateTensor, DTYPES and DTYPE_NAMES live in generate.spec_types (the loaders use them too); exported here as before
__all__ = ["SpecKind", "Shapes", "StateTensor", "Spec", "load_spec", "import_spec_file", "spec_inputs", "spec_source_hash",
           "variants_attention", "DTYPES", "DTYPE_NAMES"]

log = logging.getLogger(__name__)


class SpecKind(Enum):
    KERNELBENCH = "kernelbench"
    FLEX = "flex"
    BOTH = "both"  # mods define the variants, Model the reference


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
    init_fixed: tuple[tuple[int, str, object], ...] = ()  # (position, name, value) of constructor args baked in the kernel
    lengths_fixed: tuple[int, int] | None = None  # (M, N) the variant expressions hold, when the spec runs at no other
    # aux tensors the candidate computes from a forward input before the launch (torch.searchsorted ids):
    # aux name -> (forward input name, right)
    derived_aux: Mapping[str, tuple[str, bool]] = field(default_factory=dict)
    # a paged-KV or packed varlen spec (generate.spec_serving): shapes, aux and reference are its dense view
    layout: ServingLayout | None = None
    # an attention sink: the logit, in (b, h), of one more column of the softmax that carries no value (gpt-oss's
    # learned `sinks[h]`); its aux tensor is in `aux` (and `state`, for a parameter)
    sink: Expr | None = None

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

    @property
    def sinks(self) -> str | None:
        """The aux tensor of one sink logit per query head, when the sink is read as `NAME[h]` (gpt-oss's learned
        sinks); None without a sink. A sink of another form raises KBError: a transfer that starts the online
        softmax at `NAME[h]` would compute something else."""
        if self.sink is None:
            return None
        if self.sink.op is ExprOp.LOAD and self.sink.args == (var("h"),):
            return str(self.sink.value)
        raise KBError(f"{self.path}: the attention sink {self.sink_string()} is not one logit per query head (NAME[h])")

    def sink_string(self) -> str | None:
        """The attention sink's logit as IR expression text (`sinks[h]`); None without sinks."""
        return print_expr(self.sink) if self.sink is not None else None

    def variants_text(self) -> str:
        """The variant slots in IR text form (and the sink: the logit the online softmax starts at)."""
        score, mask = self.variant_strings()
        lines = []
        if score is not None:
            lines.append(f"score_mod(score, b, h, q_idx, kv_idx) = {score}")
        if mask is not None:
            lines.append(f"mask_mod(b, h, q_idx, kv_idx) = {mask}")
        if self.sink is not None:
            lines.append(f"sink(b, h) = {self.sink_string()}")
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
    except Exception as err:
        raise KBError(f"cannot import spec file {path}: {type(err).__name__}: {err}") from None
    except SystemExit as err:
        raise KBError(f"cannot import spec file {path}: it called sys.exit({err.code!r})") from None
    finally:
        sys.modules.pop(name, None)
    return module


def _scale_or_none(scale: float, D: int) -> float | None:
    return None if math.isclose(scale, 1.0 / math.sqrt(D), rel_tol=1e-6) else scale


def spec_source_hash(path: Path) -> str:
    """`Spec.source_hash` of the file at `path` without importing or tracing it: sha256 of its text (empty if absent)."""
    return hashlib.sha256(path.read_bytes() if path.is_file() else b"").hexdigest()  # the UTF-8 text's hash, any bytes


def load_spec(path: str | Path) -> Spec:
    """Load and trace a spec file (see module docstring); raises KBError on anything unsupported."""
    path = Path(path)
    try:
        return _load_spec(path)
    except SystemExit as err:  # the spec's code (its Model, get_inputs, mods) ran while kb traced it
        raise KBError(f"spec {path} called sys.exit({err.code!r}) while kb traced it") from None


def _load_spec(path: Path) -> Spec:
    source_hash = spec_source_hash(path)
    module = import_spec_file(path)
    has_model = all(hasattr(module, n) for n in ("Model", "get_inputs", "get_init_inputs"))
    mods = {n: getattr(module, n) for n in ("score_mod", "mask_mod") if callable(getattr(module, n, None))}
    if not has_model and not mods:
        raise KBError(f"{path} is not a spec: define Model, get_inputs and get_init_inputs (KernelBench style) "
                      "or score_mod/mask_mod with SHAPES (FlexAttention style)")
    model = load_model(module, path) if has_model else None
    flex = trace_mods(module, mods, path) if mods else None
    spec = _flex_spec(path, source_hash, flex) if model is None else _model_spec(path, source_hash, model, flex)
    log.info("spec %s: %s", path, spec.features.describe())
    _self_check(spec)
    return spec


def _flex_spec(path: Path, source_hash: str, flex: FlexMods | None) -> Spec:
    """A FlexAttention-style spec: variants from the mods, shapes from SHAPES, the mods in torch as the reference."""
    assert flex is not None, "a spec without a Model has mods"
    shapes = flex.shapes(path)
    return Spec(path, SpecKind.FLEX, flex.score_mod, flex.mask_mod, flex.aux, shapes,
                _scale_or_none(flex.scale(shapes), shapes.D), _features(flex.score_mod, flex.mask_mod, shapes, None, {}),
                source_hash, flex.reference(shapes))


def _model_spec(path: Path, source_hash: str, model: ModelSpec, flex: FlexMods | None) -> Spec:
    """A KernelBench-style spec; with mods beside the Model (BOTH), the mods define the variants."""
    score, mask, aux, scale = model.score_mod, model.mask_mod, model.aux, model.scale
    if flex is not None:
        score, mask, aux, scale = flex.score_mod, flex.mask_mod, flex.aux, flex.scale(model.shapes)
    shapes = model.shapes
    return Spec(path, SpecKind.KERNELBENCH if flex is None else SpecKind.BOTH, score, mask, aux, shapes,
                _scale_or_none(scale, shapes.D),
                _features(score, mask, shapes, model.layout, model.derived_aux, model.sink is not None),
                source_hash, model.reference, model.forward_names, model.qkv_names, model.init_params,
                out_dtype=model.out_dtype, state=model.state, state_values=model.state_values,
                heads_fixed=model.heads_fixed, init_fixed=model.init_fixed, lengths_fixed=model.lengths_fixed, derived_aux=model.derived_aux,
                layout=model.layout, sink=model.sink)


def _features(score: Expr | None, mask: Expr | None, shapes: Shapes, layout: ServingLayout | None,
              derived: Mapping[str, tuple[str, bool]], sinks: bool = False) -> Features:
    """Classified as for a dense spec; a serving spec's expressions without its layout's own bounds and read for one
    sequence filling the dense view (generate.spec_serving.one_sequence)."""
    if layout is not None:
        mask = feature_mask(mask, layout, derived, (shapes.M, shapes.N))
        score = one_sequence(score, layout, derived, shapes.M, shapes.N) if score is not None else None
    return features_from_variants(
        score, mask, head_dim=shapes.D, dtype=shapes.dtype, gqa_ratio=shapes.gqa_ratio, seq_q=shapes.M,
        seq_kv=shapes.N, paged_kv=layout is not None and layout.kind != "varlen",
        varlen=layout is not None and layout.kind in ("varlen", "chunked"), sinks=sinks,
    )


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
    tensors = spec.aux if aux is None else aux
    # dims, and each table's own sizes under the names generate.target gives them (pos_bias_n1)
    env = {"B": B, "Hq": Hq, "Hkv": Hkv, "H": Hq, "M": M, "N": N, "D": D,
           **{f"{n}_n{i}": int(size) for n, t in tensors.items() for i, size in enumerate(t.shape)}}
    s, keep = dense_scores_mask(s, spec.score_mod, spec.mask_mod, env, tensors)
    keep = keep.expand(B, Hq, M, N)
    s = s.float().masked_fill(~keep, -math.inf)
    if spec.sink is not None:  # one more column in the softmax, dropped after it (it carries no value)
        sink = torch.as_tensor(dense_scores_mask(torch.zeros(B, Hq, M, 1), spec.sink, None, env, tensors)[0]).float()
        return (torch.softmax(torch.cat([s, sink.expand(B, Hq, M, 1)], dim=-1), dim=-1)[..., :-1] @ vv).to(q.dtype)
    p = torch.softmax(s, dim=-1)
    p = torch.where(keep.any(-1, keepdim=True), p, torch.zeros((), dtype=p.dtype))
    return (p @ vv).to(q.dtype)
