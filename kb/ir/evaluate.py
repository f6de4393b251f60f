"""Evaluate IR expressions on torch tensors (broadcasting), variant functions densely, and serving layouts.

Used by the reference interpreter, by dense torch references of programs and specs, and by
mask/score classification. `varlen_attention` is the torch reference for token-major (varlen)
and paged layouts (`paged_to_token_major`, `pool_to_token_major` unpage a cache first): dense
attention run per sequence, what a lifted serving kernel is verified against. Semantics match the
lowerings: `//` and `%` are floor division/modulo, `trunc` rounds toward zero to an int64,
`&`/`|`/`~` are logical on booleans and bitwise on integers (Python's rule; `<<`, `>>` shift integers), loads
index aux tensors with (broadcast) integer index tensors.
"""

from __future__ import annotations

import math
from typing import Mapping, Protocol

import torch

from kb.errors import KBError
from kb.ir.expr import Expr, ExprOp, number

__all__ = ["eval_expr", "dense_scores_mask", "Value", "AuxTable", "varlen_attention", "paged_to_token_major", "pool_to_token_major"]

Value = torch.Tensor | int | float | bool


class AuxTable(Protocol):
    """What a LOAD reads: a tensor, or a wrapper that checks its indices (interp_variants.ClampedAux)."""

    def dim(self) -> int: ...

    def __getitem__(self, idx: tuple[torch.Tensor, ...], /) -> torch.Tensor: ...


def _t(x: Value) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(x)


def _binary(op: ExprOp, a: Value, b: Value) -> Value:
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return _scalar_binary(op, a, b)
    match op:
        case ExprOp.ADD: return a + b
        case ExprOp.SUB: return a - b
        case ExprOp.MUL: return a * b
        case ExprOp.DIV: return _t(a).to(torch.float32) / b if not torch.is_floating_point(_t(a)) else a / b
        case ExprOp.FLOORDIV: return torch.div(_t(a), b, rounding_mode="floor")
        case ExprOp.MOD: return torch.remainder(_t(a), b)
        case ExprOp.LT: return _t(a) < b
        case ExprOp.LE: return _t(a) <= b
        case ExprOp.GT: return _t(a) > b
        case ExprOp.GE: return _t(a) >= b
        case ExprOp.EQ: return _t(a) == b
        case ExprOp.NE: return _t(a) != b
        case ExprOp.AND | ExprOp.OR:
            x, y = (_t(v) for v in (a, b)) if _bitwise(a, b) else (_t(a).bool(), _t(b).bool())
            return x & y if op is ExprOp.AND else x | y
        case ExprOp.SHL: return _t(a) << b
        case ExprOp.SHR: return _t(a) >> b
    raise AssertionError(op)


def _is_int(x: Value) -> bool:
    if isinstance(x, torch.Tensor):
        return not x.is_floating_point() and x.dtype != torch.bool
    return isinstance(x, int) and not isinstance(x, bool)


def _is_bool(x: Value) -> bool:
    return x.dtype == torch.bool if isinstance(x, torch.Tensor) else isinstance(x, bool)


def _bitwise(a: Value, b: Value) -> bool:
    """`&`/`|` is bitwise when an operand is an integer and neither is a float (True & 3 == 1, as in Python);
    logical on booleans (and, as before integer support, on floats taken as truth values)."""
    return (_is_int(a) or _is_int(b)) and all(_is_int(x) or _is_bool(x) for x in (a, b))


def _scalar_binary(op: ExprOp, a: int | float | bool, b: int | float | bool) -> int | float | bool:
    match op:
        case ExprOp.ADD: return a + b
        case ExprOp.SUB: return a - b
        case ExprOp.MUL: return a * b
        case ExprOp.DIV: return a / b
        case ExprOp.FLOORDIV: return a // b
        case ExprOp.MOD: return a % b
        case ExprOp.LT: return a < b
        case ExprOp.LE: return a <= b
        case ExprOp.GT: return a > b
        case ExprOp.GE: return a >= b
        case ExprOp.EQ: return a == b
        case ExprOp.NE: return a != b
        case ExprOp.AND: return a & b if _bitwise(a, b) else bool(a) and bool(b)  # type: ignore[operator]
        case ExprOp.OR: return a | b if _bitwise(a, b) else bool(a) or bool(b)  # type: ignore[operator]
        case ExprOp.SHL: return a << b  # type: ignore[operator]
        case ExprOp.SHR: return a >> b  # type: ignore[operator]
    raise AssertionError(op)


_UNARY_T = {
    ExprOp.EXP: torch.exp, ExprOp.EXP2: torch.exp2, ExprOp.LOG: torch.log, ExprOp.TANH: torch.tanh,
    ExprOp.SIGMOID: torch.sigmoid, ExprOp.ABS: torch.abs, ExprOp.SQRT: torch.sqrt, ExprOp.ERF: torch.erf,
}
_UNARY_S = {
    ExprOp.EXP: math.exp, ExprOp.EXP2: lambda x: 2.0 ** x, ExprOp.LOG: math.log, ExprOp.TANH: math.tanh,
    ExprOp.SIGMOID: lambda x: 1.0 / (1.0 + math.exp(-x)), ExprOp.ABS: abs, ExprOp.SQRT: math.sqrt,
    ExprOp.ERF: math.erf,
}


def eval_expr(e: Expr, env: Mapping[str, Value], tensors: Mapping[str, AuxTable] | None = None) -> Value:
    """Evaluate `e`; VARs come from `env`, LOADs index `tensors` (out-of-range loads raise)."""
    op = e.op
    if op is ExprOp.CONST:
        return number(e)
    if op is ExprOp.VAR:
        try:
            return env[str(e.value)]
        except KeyError:
            raise KBError(f"expression {e} uses undefined name {e.value!r}") from None
    args = [eval_expr(a, env, tensors) for a in e.args]
    if op is ExprOp.LOAD:
        if tensors is None or str(e.value) not in tensors:
            raise KBError(f"expression {e} loads from missing tensor {e.value!r}")
        t = tensors[str(e.value)]
        if len(args) != t.dim():
            raise KBError(f"expression {e}: {e.value} has {t.dim()} dims, indexed with {len(args)}")
        idx = torch.broadcast_tensors(*[_t(a).long() for a in args])
        return t[idx]
    if op is ExprOp.NEG:
        return -args[0]
    if op is ExprOp.NOT:
        (a,) = args
        if _is_int(a):
            return ~a  # type: ignore[operator]  # bitwise on integers
        return ~_t(a).bool() if isinstance(a, torch.Tensor) else not a
    if op is ExprOp.WHERE:
        c, x, y = args
        if not isinstance(c, torch.Tensor):
            return x if c else y
        return torch.where(c.bool(), _t(x), _t(y))
    if op in (ExprOp.MAXIMUM, ExprOp.MINIMUM):
        a, b = args
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            return max(a, b) if op is ExprOp.MAXIMUM else min(a, b)
        a, b = torch.broadcast_tensors(_t(a), _t(b))
        a, b = (a, b.to(a.dtype)) if a.is_floating_point() or not b.is_floating_point() else (a.to(b.dtype), b)
        return torch.maximum(a, b) if op is ExprOp.MAXIMUM else torch.minimum(a, b)
    if op is ExprOp.CDIV:
        a, b = args
        return -(-a // b) if not isinstance(a, torch.Tensor) else torch.div(a + b - 1, b, rounding_mode="floor")
    if op is ExprOp.TRUNC:
        return _trunc(args[0])
    if op in _UNARY_T:
        (a,) = args
        return _UNARY_T[op](a.float() if isinstance(a, torch.Tensor) and not a.is_floating_point() else a) \
            if isinstance(a, torch.Tensor) else _UNARY_S[op](a)
    return _binary(op, args[0], args[1])


def _trunc(x: Value) -> Value:
    """Toward zero, an integer: torch's float -> int64 cast (a Python int for a Python scalar)."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.int64)
    if isinstance(x, float) and not math.isfinite(x):
        raise KBError(f"trunc({x}) has no integer value")
    return int(x)


def dense_scores_mask(
    scores: torch.Tensor,
    score_mod: Expr | None,
    mask_mod: Expr | None,
    env: Mapping[str, Value],
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply variant functions densely to `scores: [B, H, M, N]`.

    Returns (modified scores, boolean mask [B, H, M, N] or broadcastable). `env` supplies
    dims and scalars; b/h/q_idx/kv_idx are bound here to broadcast aranges.
    """
    B, H, M, N = scores.shape
    idx = {
        "b": torch.arange(B).view(B, 1, 1, 1),
        "h": torch.arange(H).view(1, H, 1, 1),
        "q_idx": torch.arange(M).view(1, 1, M, 1),
        "kv_idx": torch.arange(N).view(1, 1, 1, N),
    }
    full_env = {**env, **idx}
    if score_mod is not None:
        scores = _t(eval_expr(score_mod, {**full_env, "score": scores}, tensors)).to(scores.dtype)
        scores = scores.expand(B, H, M, N)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    if mask_mod is not None:
        mask = _t(eval_expr(mask_mod, full_env, tensors)).bool()
    return scores, mask


# ---------------------------------------------------------------- serving layouts (torch reference)


def _seq_mask(q_len: int, kv_len: int, causal: bool, window: int | None) -> torch.Tensor:
    """[q_len, kv_len] allowed pairs; query i sits at key position kv_len - q_len + i (bottom-right)."""
    pos = (kv_len - q_len + torch.arange(q_len)).view(q_len, 1)
    j = torch.arange(kv_len).view(1, kv_len)
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        allowed &= j <= pos
    if window is not None:
        allowed &= pos - j < window
    return allowed


def _one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [Lq, Hq, D], k/v: [Lk, Hkv, D]; returns o [Lq, Hq, Dv], lse [Lq, Hq] (float64)."""
    group = q.shape[1] // k.shape[1]
    kh = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Lk, D]
    vh = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ kh.transpose(1, 2) * sm_scale  # [Hq, Lq, Lk]
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for fully masked rows
    p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
    return (p @ vh).transpose(0, 1), lse.transpose(0, 1)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_starts: list[int],
    q_lens: list[int],
    kv_starts: list[int],
    kv_lens: list[int],
    *,
    sm_scale: float,
    causal: bool = False,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention per sequence on token-major tensors; returns (o, lse) in float32.

    q: [Tq, Hq, D], k/v: [Tk, Hkv, D|Dv]; sequence i has queries q[q_starts[i] :+ q_lens[i]] and keys
    k[kv_starts[i] :+ kv_lens[i]]. GQA: query head h reads kv head h // (Hq // Hkv). Causal is
    bottom-right aligned (query i sees keys <= kv_len - q_len + i); `window` keeps keys with
    position - key < window. Fully masked rows give o = 0, lse = -inf; rows of no sequence are 0 / -inf."""
    o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32)
    for qs, ql, ks, kl in zip(q_starts, q_lens, kv_starts, kv_lens):
        allowed = _seq_mask(ql, kl, causal, window)
        o_i, lse_i = _one_sequence(q[qs:qs + ql], k[ks:ks + kl], v[ks:ks + kl], allowed, sm_scale)
        o[qs:qs + ql], lse[qs:qs + ql] = o_i.float(), lse_i.float()
    return o, lse


def _token_major(rows: list[torch.Tensor], kv_lens: list[int]) -> tuple[torch.Tensor, list[int]]:
    starts = [sum(kv_lens[:i]) for i in range(len(kv_lens))]
    return torch.cat(rows, dim=0), starts


def paged_to_token_major(cache: torch.Tensor, block_table: torch.Tensor, kv_lens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """A vLLM cache [NUM_PAGES, PAGE, H, D] read through block_table [B, MAX_PAGES] -> ([sum kv_lens, H, D], starts)."""
    page = cache.shape[1]
    rows = [cache[block_table[b, torch.arange(n) // page].long(), torch.arange(n) % page] for b, n in enumerate(kv_lens)]
    return _token_major(rows, kv_lens)


def pool_to_token_major(pool: torch.Tensor, req_to_token: torch.Tensor, kv_lens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """An SGLang token pool [POOL, H, D] read through req_to_token [B, MAX_CTX] -> ([sum kv_lens, H, D], starts)."""
    rows = [pool[req_to_token[b, :n].long()] for b, n in enumerate(kv_lens)]
    return _token_major(rows, kv_lens)
