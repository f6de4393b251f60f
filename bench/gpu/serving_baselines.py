"""Expert baselines for the held-out serving specs (bench/heldout_serving), on the spec's own tensors (measuring only).

    fns = baselines(spec, model, inputs, vllm_src=Path("DIR"))  # DIR holds vllm/v1/attention/ops/... (the wheel's)
    fn, note = fns["vllm_unified"]                   # also "flex_paged", "flashinfer"; fn is None where a case cannot run

Each `fn()` computes what `spec.Model.forward(*inputs)` computes, on the same tensors in the engine's layout, and
returns the spec's output shape and dtype. Everything that is not the attention itself (vLLM's split-K scratch,
cumulative offsets, a block table over packed keys, FlexAttention's block mask and page maps) is built once here,
outside the callable; K and V are only ever viewed, never copied:
- `vllm_unified`: vLLM 0.33.0's `unified_attention` (the TRITON_ATTN backend's kernel), imported from the wheel's
  source with a few stub modules in place of the vLLM package; launched the way that backend launches it (causal,
  `window_size=(W - 1, 0)`, split-K scratch for `128 // Hkv` sequences in 16 segments). It writes into one buffer
  allocated here, so every call returns the same tensor (zero rows stay zero: an empty decode sequence).
- `flex_paged`: FlexAttention over the physical cache viewed as `[1, Hkv, NUM_PAGES * PAGE, D]`: PyTorch's
  `PagedAttention` page maps for the decode specs, a block mask over physical slots for the chunked prefill, a
  document mask over the packed batch for the varlen prefill. `compile=True` wraps the call in `torch.compile`.
- `flashinfer`: FlashInfer 0.7.4's wrappers (bench/gpu/serving_flashinfer.py), planned here: sink-aware paged decode,
  ALiBi paged decode, ragged causal prefill with softcap, paged prefill with causal + bidirectional ranges; None with
  the reason where flashinfer does not import or a wrapper cannot build.

vLLM's conventions, as its kernel reads them: a sliding window W is `window_size=(W - 1, 0)` (key j kept when
q_pos - j < W); ALiBi adds `slope * (j - context_len)`, i.e. `slope * (j - q_pos)` for a decode query (the spec's
sign; for a prefill row only a constant shift); sinks are any float dtype, loaded as fp32 into the running max;
`mm_prefix_range` is [B, R, 2] int32 of inclusive (start, end), a range only where start < end, and must not pass
seq_len (keys past it would score 0, not -inf).
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import sys
import types
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Callable, cast

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from bench.gpu.serving_flashinfer import flashinfer_baseline

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import AuxOutput, FlexKernelOptions

__all__ = ["baselines", "load_vllm_unified_attention", "VLLM_OPS"]

Baseline = tuple[Callable[[], Tensor] | None, str]
VLLM_OPS = "vllm/v1/attention/ops"  # where a --vllm-src directory holds the kernels
_SPLIT_SEGMENTS, _MIN_GRID_2D = 16, 128  # the TRITON_ATTN backend's split-K constants


# ---- vLLM's kernel from its source, without vLLM


class _KVQuantMode(enum.IntEnum):  # vllm.v1.kv_cache_interface.KVQuantMode: the members the kernel file names
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


class _Logger(logging.LoggerAdapter):
    def debug_once(self, msg: str, *args: object) -> None:
        self.debug(msg, *args)


def _stub(name: str, **attrs: object) -> ModuleType:
    mod = sys.modules.get(name) or types.ModuleType(name)
    mod.__dict__.setdefault("__path__", [])
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)
    return mod


def _same_family(family: int) -> bool:  # vLLM's current_platform.is_device_capability_family (100: Blackwell)
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == family // 10


def load_vllm_unified_attention(src: Path) -> Callable:
    """`unified_attention` from `src/vllm/v1/attention/ops/triton_unified_attention.py`, imported by path under its own
    module name after stubbing what it imports (vllm.envs, .logger, .platforms, .triton_utils, .v1.kv_cache_interface)."""
    name = "vllm.v1.attention.ops.triton_unified_attention"
    if name in sys.modules:
        return sys.modules[name].unified_attention
    import triton  # noqa: PLC0415  only for vLLM's kernel: importing this module leaves Triton unloaded
    import triton.language as tl  # noqa: PLC0415  as triton

    for pkg in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
        _stub(pkg)
    _stub("vllm.envs", VLLM_BATCH_INVARIANT=False)
    _stub("vllm.logger", init_logger=lambda n: _Logger(logging.getLogger(n), {}))
    platform = SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn, is_device_capability_family=_same_family)
    _stub("vllm.platforms", current_platform=platform)
    _stub("vllm.triton_utils", tl=tl, triton=triton)
    _stub("vllm.v1.kv_cache_interface", KVQuantMode=_KVQuantMode)
    for stem in ("triton_attention_helpers", "triton_unified_attention"):
        full = f"vllm.v1.attention.ops.{stem}"
        spec = importlib.util.spec_from_file_location(full, Path(src) / VLLM_OPS / f"{stem}.py")
        assert spec is not None and spec.loader is not None, f"no {stem}.py under {src / VLLM_OPS}"
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        spec.loader.exec_module(mod)
        setattr(sys.modules["vllm.v1.attention.ops"], stem, mod)
    return sys.modules[name].unified_attention


def _vllm(
    ua: Callable,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    cu_q: Tensor,
    seq_lens: Tensor,
    max_q: int,
    scale: float,
    **extra: object,
) -> Callable[[], Tensor]:
    """k, v: [pages, PAGE, Hkv, D]; the backend's call with its split-K scratch (the kernel picks 2D or 3D)."""
    hq, d, hkv = q.shape[1], q.shape[2], k.shape[2]
    rows = _MIN_GRID_2D // hkv
    segm = torch.empty(rows, hq, _SPLIT_SEGMENTS, 1 << (d - 1).bit_length(), dtype=torch.float32, device=q.device)
    segm_max = torch.empty(rows, hq, _SPLIT_SEGMENTS, dtype=torch.float32, device=q.device)
    segm_sum = torch.empty_like(segm_max)
    out = torch.zeros_like(q)
    max_k = int(seq_lens.max()) if seq_lens.numel() else 0
    kw = dict(window_size=(-1, -1), softcap=0.0, q_descale=None, k_descale=None, v_descale=None) | extra

    def run() -> Tensor:
        ua(
            q=q,
            k=k,
            v=v,
            out=out,
            cu_seqlens_q=cu_q,
            max_seqlen_q=max_q,
            seqused_k=seq_lens,
            max_seqlen_k=max_k,
            softmax_scale=scale,
            causal=True,
            block_table=table,
            seq_threshold_3D=rows,
            num_par_softmax_segments=_SPLIT_SEGMENTS,
            softmax_segm_output=segm,
            softmax_segm_max=segm_max,
            softmax_segm_expsum=segm_sum,
            **kw,
        )
        return out

    return run


def _vllm_baseline(stem: str, spec: ModuleType, model: torch.nn.Module, inputs: list, ua: Callable) -> Baseline:
    q = inputs[0]
    scale = q.shape[-1] ** -0.5  # all four Models scale by d ** -0.5
    if stem in ("paged_decode_window_sinks", "paged_gqa_decode_alibi"):
        _, k_cache, v_cache, table, seq_lens = inputs
        cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)  # one query per sequence
        if stem == "paged_decode_window_sinks":  # vLLM keeps key j when q_pos - j < window_size[0] + 1
            extra = dict(window_size=(spec.WINDOW - 1, 0), sinks=cast(Tensor, model.sinks).detach().float().contiguous())
            note = f"window_size=({spec.WINDOW - 1}, 0), sinks fp32"
        else:  # the kernel adds slope * (j - context_len), context_len = seq_len - 1 for a decode query: the spec's bias
            extra, note = dict(alibi_slopes=cast(Tensor, model.slopes).float().contiguous()), "alibi_slopes = Model.slopes"
        fn = _vllm(ua, q, k_cache, v_cache, table, cu_q, seq_lens, 1, scale, **extra)
        return fn, f"unified_attention, decode (max_seqlen_q=1), causal, {note}; no repack"
    if stem == "varlen_prefill_softcap":
        _, k, v, cu_q, cu_k, max_seqlen = inputs
        lens_k = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
        # the packed keys as pages of one token: a free view, and a block table of token indices (built here once);
        # the kernel reads the table past a sequence's end up to its tile, so rows are padded to a multiple of 128
        width = max(128, -(-max_seqlen // 128) * 128)
        table = (cu_k[:-1, None] + torch.arange(width, device=q.device)).clamp_(0, max(k.shape[0] - 1, 0)).to(torch.int32)
        one_token_pages = k.unsqueeze(1), v.unsqueeze(1)  # [T, 1, Hkv, D]
        fn = _vllm(ua, q, *one_token_pages, table, cu_q, lens_k, max_seqlen, scale, softcap=float(spec.SOFTCAP))
        return fn, (
            f"unified_attention over k, v viewed as pages of 1 token (block table = token index; TRITON_ATTN "
            f"itself allocates pages of 16), causal bottom-right, softcap={spec.SOFTCAP}; no repack"
        )
    if stem == "chunked_prefill_prefix_lm":
        _, k_cache, v_cache, table, seq_lens, qsl, prefix = inputs
        # mm_prefix_range [B, 1, 2]: keys and queries in [start, end] (end inclusive; start < end, else no range)
        # see each other; (0, min(prefix, seq_len) - 1) ORed with causal is the spec's prefix-LM mask
        end = (torch.minimum(prefix, seq_lens) - 1).clamp(min=0)
        mm = torch.stack([torch.zeros_like(end), end], dim=-1).unsqueeze(1).to(torch.int32).contiguous()
        max_q = int((qsl[1:] - qsl[:-1]).max())
        fn = _vllm(ua, q, k_cache, v_cache, table, qsl, seq_lens, max_q, scale, mm_prefix_range=mm)
        return fn, "unified_attention, causal + mm_prefix_range (0, min(prefix, seq_len) - 1); no repack"
    return None, f"no vLLM mapping for {stem}"


# ---- FlexAttention over the physical cache


def _compiled(run: Callable[[], Tensor], compile: bool) -> Callable[[], Tensor]:
    """`run` (flex_attention and what follows it) as one torch.compile graph: the fused kernel, not the eager one."""
    return torch.compile(run, dynamic=False) if compile else run


def _cache_view(cache: Tensor) -> Tensor:  # [pages, PAGE, Hkv, D] -> [1, Hkv, pages * PAGE, D], a view
    return cache.flatten(0, 1).unsqueeze(0).transpose(1, 2)


def _flex_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    table: Tensor,
    seq_lens: Tensor,
    compile: bool,
    mask_mod: Callable,
    score_mod: Callable | None = None,
    sinks: Tensor | None = None,
) -> Callable:
    """PyTorch's PagedAttention: its page table and physical-to-logical map filled from the engine's block_table."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention  # noqa: PLC0415  experimental API
    from torch.nn.attention.flex_attention import AuxRequest  # noqa: PLC0415  recent (torch >= 2.9): this baseline only

    b, max_pages = table.shape
    pages, page = k_cache.shape[:2]
    paged = PagedAttention(pages, page, b, device=str(q.device))
    paged.page_table[:, :max_pages] = table
    logical = torch.arange(max_pages, device=q.device).expand(b, -1)
    paged.physical_to_logical.scatter_(1, table.long(), logical)
    logical_mask = create_block_mask(mask_mod, b, None, 1, max_pages * page, device=q.device, BLOCK_SIZE=(128, page))
    block_mask = paged.convert_logical_block_mask(logical_mask, kv_len=seq_lens)
    score = paged.get_score_mod(score_mod, kv_len=seq_lens) if score_mod is not None else None
    k, v, q4 = _cache_view(k_cache), _cache_view(v_cache), q.unsqueeze(2)
    aux = AuxRequest(lse=True) if sinks is not None else None

    def run() -> Tensor:
        res = flex_attention(q4, k, v, score, block_mask, q.shape[-1] ** -0.5, enable_gqa=True, return_aux=aux)
        if sinks is None:
            return cast(Tensor, res).squeeze(2)  # return_aux=None: the output alone
        o, a = cast("tuple[Tensor, AuxOutput]", res)  # return_aux=aux, which asks for the lse
        assert a.lse is not None
        # a sink joins the denominator only: o * sum / (sum + e^sink) = o * sigmoid(lse - sink)
        return (o.float() * torch.sigmoid(a.lse - sinks[None, :, None]).unsqueeze(-1)).to(q.dtype).squeeze(2)

    return _compiled(run, compile)


def _flex_baseline(stem: str, spec: ModuleType, model: torch.nn.Module, inputs: list, compile: bool) -> Baseline:
    q, dev = inputs[0], inputs[0].device
    if stem == "paged_decode_window_sinks":
        _, k_cache, v_cache, table, seq_lens = inputs
        last, window = seq_lens - 1, spec.WINDOW

        def in_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx <= last[b]) & (kv_idx > last[b] - window)

        sinks = cast(Tensor, model.sinks).detach().float()
        fn = _flex_decode(q, k_cache, v_cache, table, seq_lens, compile, in_window, sinks=sinks)
        return fn, "flex_attention + PagedAttention block mask (window), sinks as o * sigmoid(lse - sink) after it"
    if stem == "paged_gqa_decode_alibi":
        _, k_cache, v_cache, table, seq_lens = inputs
        last, slopes = seq_lens - 1, cast(Tensor, model.slopes)

        def in_seq(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return kv_idx <= last[b]

        def alibi(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + slopes[h] * (kv_idx - last[b])

        fn = _flex_decode(q, k_cache, v_cache, table, seq_lens, compile, in_seq, alibi)
        return fn, "flex_attention + PagedAttention block mask, ALiBi score_mod"
    if stem == "varlen_prefill_softcap":
        _, k, v, cu_q, cu_k, _ = inputs
        tq, tk = q.shape[0], k.shape[0]
        seq_q = torch.searchsorted(cu_q, torch.arange(tq, device=dev), right=True) - 1
        seq_k = torch.searchsorted(cu_k, torch.arange(tk, device=dev), right=True) - 1
        pos_k = torch.arange(tk, device=dev) - cu_k[seq_k]
        diag = torch.arange(tq, device=dev) - cu_q[seq_q] + (cu_k[1:] - cu_k[:-1] - cu_q[1:] + cu_q[:-1])[seq_q]
        cap = float(spec.SOFTCAP)

        def document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (seq_q[q_idx] == seq_k[kv_idx]) & (pos_k[kv_idx] <= diag[q_idx])

        def softcap(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return cap * torch.tanh(score / cap)

        mask = create_block_mask(document, 1, None, tq, tk, device=dev, _compile=compile)
        q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, T, D] views

        def run() -> Tensor:
            o = flex_attention(q4, k4, v4, softcap, mask, scale=q.shape[-1] ** -0.5, enable_gqa=True)
            return o[0].transpose(0, 1)

        note = "flex_attention, B=1 document mask over the packed batch (bottom-right causal), softcap score_mod"
        return _compiled(run, compile), note
    if stem == "chunked_prefill_prefix_lm":
        _, k_cache, v_cache, table, seq_lens, qsl, prefix = inputs
        tq, (pages, page), (nseq, max_pages) = q.shape[0], k_cache.shape[:2], table.shape
        seq = torch.searchsorted(qsl, torch.arange(tq, device=dev), right=True) - 1
        pos = seq_lens[seq] - (qsl[1:] - qsl[:-1])[seq] + torch.arange(tq, device=dev) - qsl[seq]
        to_logical = torch.full((nseq, pages), -1, dtype=torch.int64, device=dev)
        to_logical.scatter_(1, table.long(), torch.arange(max_pages, device=dev).expand(nseq, -1))

        def prefix_lm(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            s = seq[q_idx]
            lp = to_logical[s, kv_idx // page]
            j = lp * page + kv_idx % page
            return (lp >= 0) & (j < seq_lens[s]) & ((j < prefix[s]) | (j <= pos[q_idx]))

        # a block mask over physical slots: its KV blocks are pages, so the kernel's BLOCK_N may not exceed PAGE
        mask = create_block_mask(prefix_lm, 1, None, tq, pages * page, device=dev, BLOCK_SIZE=(128, page), _compile=compile)
        k, v, q4 = _cache_view(k_cache), _cache_view(v_cache), q.transpose(0, 1)[None]
        opts: FlexKernelOptions | None = {"BLOCK_N": page} if compile else None

        def run() -> Tensor:
            o = flex_attention(q4, k, v, None, mask, scale=q.shape[-1] ** -0.5, enable_gqa=True, kernel_options=opts)
            return o[0].transpose(0, 1)

        note = f"flex_attention, B=1 packed queries, block mask over physical pages (kernel BLOCK_N={page}), prefix-LM"
        return _compiled(run, compile), note
    return None, f"no FlexAttention mapping for {stem}"


def baselines(
    spec_module: ModuleType, model: torch.nn.Module, inputs: list, vllm_src: Path | None, *, compile: bool = True
) -> dict[str, Baseline]:
    """{"vllm_unified": (fn, note), "flex_paged": (fn, note), "flashinfer": (fn, note)} for one held-out serving spec
    (named by its file) and the inputs its Model takes; fn() returns the Model's output shape and dtype, or is None
    with the reason in note."""
    assert spec_module.__file__ is not None  # a spec is loaded from its file
    stem = Path(spec_module.__file__).stem
    if vllm_src is None:
        vllm: Baseline = (None, "no vLLM source given (--vllm-src)")
    else:
        vllm = _vllm_baseline(stem, spec_module, model, inputs, load_vllm_unified_attention(vllm_src))
    return {
        "vllm_unified": vllm,
        "flex_paged": _flex_baseline(stem, spec_module, model, inputs, compile),
        "flashinfer": flashinfer_baseline(stem, spec_module, model, inputs),
    }
