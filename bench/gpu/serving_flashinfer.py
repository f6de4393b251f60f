"""FlashInfer's attention wrappers on the held-out serving specs' own tensors (a third baseline; measuring only).

    fn, note = flashinfer_baseline(stem, spec, model, inputs)  # fn is None where a spec cannot map or flashinfer won't load

FlashInfer (`flashinfer-python` 0.7.4, imported here only) is planned once outside fn: the CSR page arrays (indptr,
indices, last_page_len) from the engine's block_table and seq_lens, a zeroed 128 MiB workspace, the output buffer, the
per-query-token ranges; fn() is the wrapper's run() on the spec's K/V (k_cache, v_cache as a tuple in "NHD", i.e.
vLLM's [pages, PAGE, Hkv, D]; only viewed). Each run writes into one buffer allocated here, so every call returns the
same tensor. plan() does the host work; serving.py captures run() in a CUDA graph (a capture that fails is its result).
- window + sinks: `BatchDecodeWithAttentionSinkWrapper`, window_left = WINDOW - 1, sinks fp32 (backend auto: fa3 on
  sm90a, whose SM90 plan does not split KV, so a row meets its sink once);
- ALiBi decode: `BatchDecodeWithPagedKVCacheWrapper`, pos_encoding_mode "ALIBI" (its own slopes, checked equal to
  the Model's);
- varlen softcap: `BatchPrefillWithRaggedKVCacheWrapper`, causal, logits_soft_cap;
- chunked prefix-LM: `BatchPrefillWithCausalBidirectionalRangesWrapper` (fa2), each query token's bidirectional range
  (0, min(prefix, seq_len) - 1) ORed with causal.

FlashInfer's conventions (0.7.4 sources): window_left W keeps key j when q_abs - j <= W (`kv_idx + qo_len +
window_left >= kv_len + qo_idx`), so the spec's WINDOW keys are W = WINDOW - 1; causal is bottom-right (fa2 masks
`kv_idx + qo_len > kv_len + q_idx`, fa3 keeps kv_idx < qo_idx + 1 + kv_len - qo_len); ALiBi adds
`slope * (kv_idx - qo_idx)` after the scale with qo_idx = 0 for a decode query, i.e. slope * j: the spec's bias plus
slope * (seq_len - 1), a constant per row that the softmax cancels; softcap is cap * tanh(score * scale / cap); a
sink is a logit on the scaled scores' scale (`sink * log2e` joins the running max and denominator, no value).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable, cast

import torch
from torch import Tensor

__all__ = ["flashinfer_baseline"]

Baseline = tuple[Callable[[], Tensor] | None, str]
_WORKSPACE = 128 << 20  # bytes: FlashInfer's recommended float workspace (split-K partials)


def _csr(table: Tensor, seq_lens: Tensor, page: int) -> tuple[Tensor, Tensor, Tensor]:
    """vLLM's [B, MAX_PAGES] block table as FlashInfer's paged indptr, indices, last_page_len (0 for an empty
    sequence: FlashInfer's kv_len is (pages - 1) * page + last_page_len)."""
    pages = (seq_lens.long() + page - 1) // page
    indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).to(torch.int32)
    keep = torch.arange(table.shape[1], device=table.device)[None, :] < pages[:, None]
    last = torch.where(pages > 0, seq_lens.long() - (pages - 1) * page, 0).to(torch.int32)
    return indptr, table[keep].to(torch.int32).contiguous(), last


def _run(fn: Callable[..., object], *args: object, **kw: object) -> Callable[[], Tensor]:
    def run() -> Tensor:
        return cast(Tensor, fn(*args, **kw))

    return run


def flashinfer_baseline(stem: str, spec: ModuleType, model: torch.nn.Module, inputs: list) -> Baseline:
    """(fn, note) for one held-out serving spec, named by its file stem; fn is None with the reason in note."""
    try:
        fi = importlib.import_module("flashinfer")  # optional: not a dependency of the project
    except ImportError as err:
        return None, f"flashinfer not importable: {type(err).__name__}: {err}"[:300]
    try:
        return _mapped(fi, stem, spec, model, inputs)
    except Exception as err:  # a JIT build or plan that fails is this baseline's result, not the bench's
        return None, f"flashinfer {fi.__version__}: {type(err).__name__}: {err}"[:500]


def _mapped(fi: ModuleType, stem: str, spec: ModuleType, model: torch.nn.Module, inputs: list) -> Baseline:
    q = inputs[0]
    hq, d, dev = q.shape[1], q.shape[2], q.device
    scale = d ** -0.5  # all four Models scale by d ** -0.5
    ws = torch.zeros(_WORKSPACE, dtype=torch.uint8, device=dev)
    out = torch.zeros_like(q)  # zero rows stay zero: an empty decode sequence
    dtypes = dict(q_data_type=q.dtype, kv_data_type=inputs[1].dtype)
    ver = f"flashinfer {fi.__version__}"
    if stem in ("paged_decode_window_sinks", "paged_gqa_decode_alibi"):
        _, k_cache, v_cache, table, seq_lens = inputs
        page, hkv = k_cache.shape[1], k_cache.shape[2]
        indptr, indices, last = _csr(table, seq_lens, page)
        if stem == "paged_decode_window_sinks":
            w = spec.WINDOW - 1  # FlashInfer keeps q_abs - j <= window_left: WINDOW keys
            dec = fi.BatchDecodeWithAttentionSinkWrapper(ws, "NHD", head_dim_qk=d, head_dim_vo=d, window_left=w, **dtypes)
            dec.plan(indptr, indices, last, hq, hkv, d, page, window_left=w, sm_scale=scale, **dtypes)
            sinks = cast(Tensor, model.sinks).detach().float().contiguous()
            fn = _run(dec.run, q, (k_cache, v_cache), sinks, scale, out=out)
            return fn, f"{ver} BatchDecodeWithAttentionSinkWrapper ({dec.resolved_backend}), window_left={w}, sinks fp32"
        slopes = cast(Tensor, model.slopes).float().cpu()
        if not torch.allclose(slopes, fi.utils.get_alibi_slopes(hq)):  # ALiBi takes no slopes argument
            return None, f"{ver}: the Model's ALiBi slopes are not FlashInfer's get_alibi_slopes({hq})"
        dec = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        dec.plan(indptr, indices, last, hq, hkv, d, page, pos_encoding_mode="ALIBI", sm_scale=scale, **dtypes)
        fn = _run(dec.run, q, (k_cache, v_cache), out=out)
        return fn, (
            f"{ver} BatchDecodeWithPagedKVCacheWrapper ({dec.resolved_backend}, CUDA-core decode), "
            "pos_encoding_mode=ALIBI: slope * j, the spec's bias up to a per-row constant"
        )
    if stem == "varlen_prefill_softcap":
        _, k, v, cu_q, cu_k, _ = inputs
        pre = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        pre.plan(cu_q, cu_k, hq, k.shape[1], d, causal=True, logits_soft_cap=float(spec.SOFTCAP), sm_scale=scale, **dtypes)
        fn = _run(pre.run, q, k, v, out=out)
        backend = getattr(pre, "_backend", "auto")  # the ragged wrapper has no resolved_backend property
        return fn, f"{ver} BatchPrefillWithRaggedKVCacheWrapper ({backend}), causal, logits_soft_cap={spec.SOFTCAP}"
    if stem == "chunked_prefill_prefix_lm":
        _, k_cache, v_cache, table, seq_lens, qsl, prefix = inputs
        page, hkv = k_cache.shape[1], k_cache.shape[2]
        indptr, indices, last = _csr(table, seq_lens, page)
        # each query token's inclusive bidirectional key range: (0, min(prefix, seq_len) - 1), (-1, -1) for none;
        # FlashInfer ORs it with bottom-right causal, which is the spec's prefix-LM mask
        seq = torch.searchsorted(qsl, torch.arange(q.shape[0], device=dev, dtype=qsl.dtype), right=True) - 1
        end = (torch.minimum(prefix, seq_lens).long() - 1)[seq]
        ranges = torch.stack([torch.where(end >= 0, 0, -1), end.clamp(min=-1)], dim=-1).to(torch.int32).contiguous()
        pre = fi.BatchPrefillWithCausalBidirectionalRangesWrapper(ws, "NHD", head_dim_qk=d, head_dim_vo=d, **dtypes)
        pre.plan(qsl, indptr, indices, last, hq, hkv, d, page, sm_scale=scale, **dtypes)
        fn = _run(pre.run, q, (k_cache, v_cache), ranges, out=out)
        return fn, f"{ver} BatchPrefillWithCausalBidirectionalRangesWrapper (fa2), ranges (0, min(prefix, seq_len) - 1)"
    return None, f"no FlashInfer mapping for {stem}"
