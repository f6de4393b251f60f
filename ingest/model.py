"""Plain results of fetching and lifting, before anything is written to the store.

Invariants:
- Every lifted artefact carries a `Provenance` whose 1-based, inclusive line span points into
  the fetched file (`file` is relative to `FetchedSource.root`).
- `LiftedSnippet.ir_text` is either an IR expression (parsed by `kb.ir.expr.parse_expr`) or one
  IR statement line whose first word is in `IR_STATEMENT_HEADS` (see docs/ir.md); use
  `ir_is_statement` to tell them apart.
- `LiftedSnippet.text` is read from the downloaded file at lift time and is never committed.
- `LiftedSnippet.features` uses `kb.features.Features` field names only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path

from kb.features import Features
from kb.ir.nodes import Program

__all__ = [
    "SourceKind",
    "Provenance",
    "LiftedSnippet",
    "LiftedTunable",
    "LiftedProgram",
    "FetchedSource",
    "LiftReport",
    "SNIPPET_KINDS",
    "IR_STATEMENT_HEADS",
    "ir_is_statement",
    "as_int",
]


class SourceKind(str, Enum):
    SDIST = "sdist"
    WHEEL = "wheel"
    LOCAL = "local"


# The fixed vocabulary of snippet kinds (what a region of an expert kernel does).
SNIPPET_KINDS = (
    "mask_causal",
    "mask_local",
    "mask_bounds",
    "mask_mod",
    "block_sparse",
    "online_softmax",
    "softmax_rescale",
    "softmax_finalize",
    "alibi",
    "softcap",
    "score_mod",
    "dropout",
    "split_kv_combine",
    "split_kv_heuristic",
    "paged_kv",
    "gqa",
    "varlen",
    "epilogue",
    "kv_loop_bounds",
    "rotary",
    "block_info",
    "schedule",
    # backward pass (features carry backward=True)
    "bwd_delta",  # delta = rowsum(o * dO)
    "bwd_probs",  # P recomputed from the saved lse
    "bwd_softmax_grad",  # dS = P * (dP - delta)
    "bwd_dq_accumulate",  # dQ += dS K (atomics, load-add-store, or a separate pass)
    "bwd_dkdv_epilogue",  # dK, dV written back (scaled)
    "bwd_loop_bounds",  # the loop over q blocks of a KV block (causal start)
    "bwd_score_mod_grad",  # dS times the derivative of score_mod (softcap's d tanh)
)

# First words of IR statement lines (docs/ir.md grammar); anything else is an expression.
IR_STATEMENT_HEADS = (
    "let", "load", "store", "init", "dot", "elementwise", "reduce", "score_mod", "mask",
    "online_softmax", "finalize", "combine", "for", "if", "schedule",
    "probs", "softmax_grad", "score_mod_grad", "aux_grad",
)

_FEATURE_NAMES = frozenset(f.name for f in fields(Features))


def ir_is_statement(ir_text: str) -> bool:
    """True when `ir_text` is an IR statement line rather than an expression."""
    head, _, rest = ir_text.strip().partition(" ")
    return head in IR_STATEMENT_HEADS and bool(rest) and rest[0] not in "=<>!+-*/%&|"


def as_int(value: object) -> int:
    """int() of an untyped value (a tunable's param, a constant folded from source); TypeError where int() has none."""
    if not isinstance(value, (int, float, str, bytes)):
        raise TypeError(f"int() cannot take {value!r}")
    return int(value)


@dataclass(frozen=True)
class Provenance:
    distribution: str
    version: str
    file: str  # relative to the fetched source root, '/'-separated
    line_start: int  # 1-based, inclusive
    line_end: int  # 1-based, inclusive
    lifter: str  # "cuda", "cute", "triton"
    lifter_version: str


@dataclass(frozen=True)
class LiftedSnippet:
    kind: str  # one of SNIPPET_KINDS
    title: str
    ir_text: str
    text: str  # the source excerpt, exactly lines line_start..line_end
    features: dict[str, object]
    provenance: Provenance

    def __post_init__(self) -> None:
        if self.kind not in SNIPPET_KINDS:
            raise ValueError(f"unknown snippet kind {self.kind!r}")
        unknown = set(self.features) - _FEATURE_NAMES
        if unknown:
            raise ValueError(f"unknown feature names {sorted(unknown)}")


@dataclass(frozen=True)
class LiftedTunable:
    family: str  # e.g. "fa2_cuda", "cutlass_fmha_sm90", "fa4_cute"
    arch: str  # "sm80", "sm86", "sm90", "sm100", "any"
    head_dim: int
    dtype: str  # "bf16", "fp16", "any"
    params: dict[str, object]  # block_m, block_n, num_warps, num_stages, ...
    condition: str  # C/Python condition under which the source picks these params ("" = always)
    provenance: Provenance


@dataclass(frozen=True)
class LiftedProgram:
    """One IR program lifted from a Triton kernel (forward or backward) for one flag combination, with what checked it."""

    name: str
    family: str
    program: Program
    provenance: Provenance
    tunables: tuple[LiftedTunable, ...]
    verified: bool
    verify_note: str
    features: Features
    flags: tuple[tuple[str, bool], ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class FetchedSource:
    distribution: str
    version: str
    kind: SourceKind
    filename: str  # the archive (or local file/dir) name
    sha256: str  # of the archive; for local sources, of the content
    root: Path  # unpacked tree (local: the directory itself)


@dataclass(frozen=True)
class LiftReport:
    file: str
    programs: tuple[LiftedProgram, ...] = ()  # IR programs (Triton lifter only)
    snippets: tuple[LiftedSnippet, ...] = ()
    tunables: tuple[LiftedTunable, ...] = ()
    skipped: tuple[tuple[str, str], ...] = field(default=())  # (what, reason)
    backward: tuple[tuple[str, str], ...] = field(default=())  # (backward kernel or region, what became of it)
