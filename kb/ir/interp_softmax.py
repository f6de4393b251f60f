"""The softmax state machine of the IR: online update, finalize and split-KV combine (fp32).

Invariants (FlashAttention-2's choices, natural-log space):
- A row that has seen only -inf scores keeps m = -inf, l = 0, acc = 0: every value stays
  finite or -inf, never NaN (the max used for exponentials is 0 when m_new = -inf).
- finalize: o = acc / l, lse = m + log(l); where l == 0, o = 0 and lse = -inf.
- combine: parts with lse = -inf contribute nothing (even if their o is NaN/poisoned).
- probs (backward): p = exp(s - lse) is 0 where s or lse is -inf (and so for rows past M loaded with lse = +inf).
"""

from __future__ import annotations

import torch

from kb.errors import KBError

__all__ = ["online_softmax_step", "finalize", "combine", "probs", "softmax_grad"]

_NEG_INF = float("-inf")


def online_softmax_step(
    m: torch.Tensor,  # [BM]
    l: torch.Tensor,  # [BM]
    acc: torch.Tensor,  # [BM, HP]
    s: torch.Tensor,  # [BM, BN]
    v: torch.Tensor,  # [BN, HP]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One update: m' = max(m, rowmax s); alpha = exp(m - m'); p = exp(s - m'); l' = l alpha + sum p; acc' = acc alpha + p @ v."""
    if s.dim() != 2 or m.shape != s.shape[:1] or l.shape != m.shape or acc.shape != (s.shape[0], v.shape[-1]) \
            or v.dim() != 2 or v.shape[0] != s.shape[1]:
        raise KBError(f"online_softmax shapes do not fit: m {list(m.shape)}, l {list(l.shape)}, "
                      f"acc {list(acc.shape)}, scores {list(s.shape)}, values {list(v.shape)}")
    s, m, l, acc = s.float(), m.float(), l.float(), acc.float()
    m_new = torch.maximum(m, s.amax(dim=1))
    m_safe = torch.where(m_new == _NEG_INF, torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)
    p = torch.exp(s - m_safe[:, None])
    l_new = l * alpha + p.sum(dim=1)
    acc_new = acc * alpha[:, None] + p @ v.float()
    return m_new, l_new, acc_new


def finalize(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) from the running state; fully masked rows give (0, -inf)."""
    empty = l == 0
    safe_l = torch.where(empty, torch.ones_like(l), l)
    o = torch.where(empty[:, None], torch.zeros_like(acc), acc.float() / safe_l[:, None])
    lse = torch.where(empty, torch.full_like(m, _NEG_INF), m.float() + torch.log(safe_l))
    return o, lse


def combine(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE merge along axis 0: o_parts [S, BM, HP], lse_parts [S, BM] -> o [BM, HP], lse [BM]."""
    if o_parts.shape[:2] != lse_parts.shape or o_parts.dim() != 3:
        raise KBError(f"combine expects o_parts [S, BM, HP] and lse_parts [S, BM], got "
                      f"{list(o_parts.shape)} and {list(lse_parts.shape)}")
    lse_parts = lse_parts.float()
    lse = torch.logsumexp(lse_parts, dim=0)  # all -inf -> -inf
    live = lse_parts != _NEG_INF
    w = torch.where(live, torch.exp(lse_parts - torch.where(lse == _NEG_INF, 0.0, lse)), 0.0)
    o = torch.where(live[..., None], w[..., None] * o_parts.float(), 0.0).sum(dim=0)
    return o, lse


def probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Backward's recomputed P: exp(s - lse[:, None]); 0 where s or the row's lse is -inf."""
    if s.dim() != 2 or lse.shape != s.shape[:1]:
        raise KBError(f"probs needs scores [R, C] and lse [R], got {list(s.shape)} and {list(lse.shape)}")
    s, lse = s.float(), lse.float()[:, None]
    p = torch.exp(s - lse)
    return torch.where((s == _NEG_INF) | (lse == _NEG_INF), torch.zeros_like(p), p)


def softmax_grad(p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dS = P * (dP - delta[:, None]) (delta = rowsum(dO * O))."""
    if p.dim() != 2 or dp.shape != p.shape or delta.shape != p.shape[:1]:
        raise KBError(f"softmax_grad needs p, dp [R, C] and delta [R], got {list(p.shape)}, "
                      f"{list(dp.shape)} and {list(delta.shape)}")
    return p.float() * (dp.float() - delta.float()[:, None])
