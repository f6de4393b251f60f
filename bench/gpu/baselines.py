"""The implementations timed beside the generated kernel, each as `fn() -> o` over fixed inputs.

SDPA runs with one backend forced (`sdpa_kernel`): flash and cuDNN where the variant is plain
causal attention (is_causal), efficient/cuDNN/math with an explicit attn_mask (bool or additive
bias) otherwise; FlexAttention is `torch.compile(flex_attention)` with `create_block_mask` and the
variant's score_mod; eager is matmul + softmax in fp32. An implementation that cannot run a
variant raises `Unsupported`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from bench.gpu.suite import Case, MaskFn, ScoreFn

__all__ = ["Unsupported", "sdpa_fn", "flex_fn", "eager_fn", "dense_mask_bias"]


class Unsupported(Exception):
    """This implementation does not accept the variant."""


def dense_mask_bias(case: Case, mask: MaskFn | None, score: ScoreFn | None, device: torch.device) -> torch.Tensor | None:
    """SDPA attn_mask: bool [B|1, 1, S, S] for masks, additive bf16 [1, Hq, S, S] for ALiBi; None for none."""
    if case.variant in ("softcap",):
        raise Unsupported("softcap is not expressible as an SDPA attn_mask")
    q = torch.arange(case.S, device=device).view(-1, 1)
    kv = torch.arange(case.S, device=device).view(1, -1)
    keep = None
    if mask is not None:
        rows = [torch.as_tensor(mask(torch.tensor(b, device=device), torch.tensor(0, device=device), q, kv))
                for b in range(case.B if case.variant in ("document", "prefix_lm") else 1)]
        keep = torch.stack([r.expand(case.S, case.S) for r in rows]).unsqueeze(1)  # [B|1, 1, S, S]
    if score is None:
        return keep
    h = torch.arange(case.Hq, device=device).view(-1, 1, 1)
    zero = torch.zeros((), device=device)
    bias = score(zero, torch.tensor(0, device=device), h, q.view(1, -1, 1), kv.view(1, 1, -1)).to(torch.bfloat16)
    if keep is not None:
        bias = bias.masked_fill(~keep[0], float("-inf"))
    return bias.unsqueeze(0)


_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def sdpa_fn(backend: str, case: Case, q, k, v, attn_mask: torch.Tensor | None, causal: bool) -> Callable[[], torch.Tensor]:
    be = getattr(SDPBackend, _BACKENDS[backend])
    gqa = case.Hq != case.Hkv
    if backend in ("flash", "cudnn") and not causal and attn_mask is not None:
        raise Unsupported(f"sdpa-{backend} is timed on plain/causal attention only")

    def run() -> torch.Tensor:
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else attn_mask, is_causal=causal,
                                                  enable_gqa=gqa)
    return run


_FLEX_COMPILED = None


def flex_fn(case: Case, q, k, v, mask: MaskFn | None, score: ScoreFn | None) -> Callable[[], torch.Tensor]:
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        import torch._dynamo  # noqa: PLC0415  a second to import (and Triton with it): only FlexAttention needs it

        # one compile per (variant, shape): the suite needs more than dynamo's default 8 recompiles,
        # past which flex_attention silently falls back to the unfused, materialising path
        torch._dynamo.config.recompile_limit = 256
        torch._dynamo.config.cache_size_limit = 256
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if mask is not None:
        per_b = case.variant in ("document", "prefix_lm")
        block_mask = create_block_mask(mask, case.B if per_b else None, None, case.S, case.S, device=q.device)
    fn = _FLEX_COMPILED
    gqa = case.Hq != case.Hkv
    return lambda: fn(q, k, v, score_mod=score, block_mask=block_mask, enable_gqa=gqa)


def eager_fn(case: Case, q, k, v, mask: MaskFn | None, score: ScoreFn | None) -> Callable[[], torch.Tensor]:
    """Plain PyTorch: fp32 scores, the variant applied densely, softmax, bf16 P @ V."""
    device = q.device
    rep = case.Hq // case.Hkv
    qi = torch.arange(case.S, device=device).view(1, 1, -1, 1)
    ki = torch.arange(case.S, device=device).view(1, 1, 1, -1)
    bi = torch.arange(case.B, device=device).view(-1, 1, 1, 1)
    hi = torch.arange(case.Hq, device=device).view(1, -1, 1, 1)

    def run() -> torch.Tensor:
        kk, vv = (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)) if rep > 1 else (k, v)
        s = (q @ kk.transpose(-1, -2)).float() * (1.0 / math.sqrt(case.D))
        if score is not None:
            s = score(s, bi, hi, qi, ki)
        if mask is not None:
            s = s.masked_fill(~torch.as_tensor(mask(bi, hi, qi, ki)), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        return p.to(v.dtype) @ vv
    return run
