"""Benchmark suites: which variants, shapes and schedules `kb bench` times.

A `Case` is one (variant, B, Hq, Hkv, S, D) point. A `Variant` knows its IR program (from
`bench/kernels/<name>.kbir` when present, else the test builders adapted to bf16), its torch
mask_mod / score_mod for FlexAttention, eager and SDPA, and its aux tensors. Invariant: the IR
program and the torch functions describe the same attention (checked at run time by comparing
outputs before anything is timed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kb.errors import KBError
from kb.ir.nodes import Dtype, Param, Program, Role, Schedule
from kb.ir.text import parse_program

__all__ = ["Case", "Variant", "VARIANTS", "SUITES", "suite_cases", "attended_pairs",
           "attention_flops", "load_program"]

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"
WINDOW, SOFTCAP, N_DOCS = 1024, 30.0, 8

MaskFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Case:
    variant: str
    B: int
    Hq: int
    Hkv: int
    S: int
    D: int

    @property
    def label(self) -> str:
        return f"{self.variant} B{self.B} H{self.Hq}/{self.Hkv} S{self.S} D{self.D}"


@dataclass(frozen=True)
class Variant:
    """One attention variant: IR builder arguments plus the torch functions of the same semantics."""

    name: str
    mask_mod: str | None  # IR text of mask_mod, None for none
    score_mod: str | None
    hi: str = "N"
    lo: str = "0"
    causal: bool = False  # SDPA's is_causal applies (plain causal / GQA)
    sdpa_mask: bool = True  # expressible as an SDPA attn_mask (bool or additive bias)
    scalars: tuple[str, ...] = ()
    aux: tuple[Param, ...] = ()


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("plain", None, None),
    Variant("causal", "q_idx >= kv_idx", None, hi="minimum(N, m_start + BLOCK_M)", causal=True),
    Variant("sliding_window", f"(q_idx >= kv_idx) & (q_idx - kv_idx < {WINDOW})", None,
            lo=f"maximum(0, (m_start - {WINDOW - 1}) // BLOCK_N * BLOCK_N)", hi="minimum(N, m_start + BLOCK_M)"),
    Variant("alibi", "q_idx >= kv_idx", "score + slopes[h] * (kv_idx - q_idx)", hi="minimum(N, m_start + BLOCK_M)",
            aux=(Param("slopes", ("Hq",), Dtype.F32, Role.AUX),)),
    Variant("softcap", "q_idx >= kv_idx", "softcap * tanh(score / softcap)", hi="minimum(N, m_start + BLOCK_M)",
            sdpa_mask=False, scalars=("softcap",)),
    Variant("document", "(doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)", None,
            hi="minimum(N, m_start + BLOCK_M)", aux=(Param("doc_ids", ("B", "N"), Dtype.I32, Role.AUX),)),
    Variant("prefix_lm", "(kv_idx < prefix_len[b]) | (q_idx >= kv_idx)", None,
            hi="minimum(N, maximum(m_start + BLOCK_M, prefix_len[b]))",
            aux=(Param("prefix_len", ("B",), Dtype.I32, Role.AUX),)),
    Variant("gqa", "q_idx >= kv_idx", None, hi="minimum(N, m_start + BLOCK_M)", causal=True),
)}

# (variant, D, S) -> B; H = 16 (GQA: Hq 16, Hkv 4); B * S = 32K tokens keeps every case >= 1 ms
_B_FOR_S = {1024: 32, 2048: 16, 4096: 8, 8192: 4, 16384: 2}


def _case(variant: str, S: int, D: int) -> Case:
    return Case(variant, _B_FOR_S[S], 16, 4 if variant == "gqa" else 16, S, D)


SUITES: dict[str, tuple[Case, ...]] = {
    # every variant at S=8K D=128; causal across S at D=128 and D=64
    "h200": tuple(_case(v, 8192, 128) for v in VARIANTS)
    + tuple(_case("causal", S, 128) for S in (1024, 4096, 16384))
    + tuple(_case("causal", S, 64) for S in (1024, 4096, 8192, 16384)),
    # the host-table (data-dependent) masks, with causal beside them: a short run for a short device budget
    "h200-masks": tuple(_case(v, 8192, 128) for v in ("document", "prefix_lm", "causal")),
    "smoke": (Case("causal", 1, 2, 2, 512, 64), Case("document", 1, 2, 2, 512, 64), Case("softcap", 1, 2, 2, 512, 128)),
}


def suite_cases(name: str) -> tuple[Case, ...]:
    if name not in SUITES:
        raise KBError(f"unknown bench suite {name!r}; choose one of {sorted(SUITES)}")
    return SUITES[name]


def load_program(variant: str) -> tuple[Program, str]:
    """(program in bf16, source): `bench/kernels/<variant>.kbir` when present, else the test builders."""
    path = KERNELS_DIR / f"{variant}.kbir"
    if path.exists():
        return parse_program(path.read_text()), f"kbir:{path.name}"
    from tests.support.ir_programs import forward  # noqa: PLC0415  a checkout only: the wheel ships the .kbir files, not tests/

    v = VARIANTS[variant]
    p = forward(variant, score_mod=v.score_mod, mask_mod=v.mask_mod, lo=v.lo, hi=v.hi, dtype=Dtype.BF16,
                aux=v.aux, scalars=v.scalars, block_classes=v.mask_mod is not None)
    return p, "builder:tests/support/ir_programs.forward"


def declared_aux(p: Program, aux: dict) -> dict:
    """The aux tensors/scalars `p` declares: a generated program may inline a constant (softcap 30.0)."""
    names = {q.name for q in p.params}
    return {n: t for n, t in aux.items() if n in names}


def with_schedule(p: Program, s: Schedule) -> Program:
    return dataclasses.replace(p, schedule=s)


# ------------------------------------------------------------------ torch semantics of each variant


def aux_tensors(case: Case, device: str | torch.device) -> dict[str, torch.Tensor | float]:
    """Aux tensors and scalars of `case`; deterministic (seeded), identical for every implementation."""
    g = torch.Generator().manual_seed(1234)
    out: dict[str, torch.Tensor | float] = {}
    if case.variant == "alibi":
        out["slopes"] = torch.tensor([2.0 ** (-8.0 * (i + 1) / case.Hq) for i in range(case.Hq)], device=device)
    if case.variant == "softcap":
        out["softcap"] = SOFTCAP
    if case.variant == "document":
        # N_DOCS documents of random lengths per batch row, sorted ids
        cuts = torch.sort(torch.randperm(case.S - 1, generator=g)[: N_DOCS - 1] + 1).values
        ids = torch.zeros(case.S, dtype=torch.int32)
        for c in cuts:
            ids[c:] += 1
        out["doc_ids"] = ids.expand(case.B, case.S).contiguous().to(device)
    if case.variant == "prefix_lm":
        out["prefix_len"] = torch.full((case.B,), case.S // 4, dtype=torch.int32, device=device)
    return out


def torch_mods(case: Case, aux: dict) -> tuple[MaskFn | None, ScoreFn | None]:
    """(mask_mod, score_mod) in FlexAttention's signature, for flex, eager and the pair count."""
    v = case.variant
    mask: MaskFn | None = None
    score: ScoreFn | None = None
    if v in ("causal", "alibi", "softcap", "gqa"):
        mask = lambda b, h, q, kv: q >= kv  # noqa: E731
    elif v == "sliding_window":
        mask = lambda b, h, q, kv: (q >= kv) & (q - kv < WINDOW)  # noqa: E731
    elif v == "document":
        doc = aux["doc_ids"]
        mask = lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv)  # noqa: E731
    elif v == "prefix_lm":
        pre = aux["prefix_len"]
        mask = lambda b, h, q, kv: (kv < pre[b]) | (q >= kv)  # noqa: E731
    if v == "alibi":
        slopes = aux["slopes"]
        score = lambda s, b, h, q, kv: s + slopes[h] * (kv - q)  # noqa: E731
    elif v == "softcap":
        cap = aux["softcap"]
        score = lambda s, b, h, q, kv: cap * torch.tanh(s / cap)  # noqa: E731
    return mask, score


def attended_pairs(case: Case, mask: MaskFn | None, device: str | torch.device, chunk: int = 2048) -> int:
    """Exact number of attended (q, kv) pairs summed over batch (per head), evaluated densely in row chunks."""
    if mask is None:
        return case.B * case.S * case.S
    total = 0
    kv = torch.arange(case.S, device=device).view(1, -1)
    for b in range(case.B):
        bt = torch.tensor(b, device=device)
        for q0 in range(0, case.S, chunk):
            q = torch.arange(q0, min(q0 + chunk, case.S), device=device).view(-1, 1)
            total += int(torch.as_tensor(mask(bt, torch.tensor(0, device=device), q, kv)).expand(q.shape[0], case.S).sum())
    return total


def attention_flops(case: Case, pairs: int) -> float:
    """4 * Hq * D * attended pairs (two matmuls of 2 FLOPs per multiply-add); masked work is not counted."""
    return 4.0 * case.Hq * case.D * pairs
