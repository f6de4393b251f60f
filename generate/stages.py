"""The stages of `kb generate` and the status words of what a run produced.

`Stage` values are stored: in each attempt row's feedback (`[ir_check/derive] ...`), in lessons, in
reports and in a generated kernel's `verify_note`; they stay these words so that existing KBs and
export files read the same. A run's own status is `kb.store.models.RunStatus` (a column of its row).
"""

from __future__ import annotations

from enum import Enum, StrEnum

__all__ = ["Stage", "ReportStatus"]


class Stage(Enum):
    """A stage of generation, in pipeline order; an attempt records the one it stopped at (or passed last)."""

    SPEC = "spec"  # load and trace the spec (generate.spec); a failure refuses the run before any attempt
    TRANSFER = "transfer"  # a program for the target: the rule engine's transfer, or the LLM's answer parsed and validated
    IR_CHECK = "ir_check"  # the program in the interpreter against the spec's reference
    LOWER = "lower"  # Triton (and CUDA) source, the candidate files
    VERIFY = "verify"  # the verify harness on the candidate
    COMPILE_CUDA = "compile_cuda"  # nvcc on the `.cu` (object only), before the kernel is written back


class ReportStatus(StrEnum):
    """What a run's report says its files are (`status`, and the backward section's)."""

    VERIFIED = "verified"
    UNVERIFIED = "generated, not verified"  # --no-verify
    FAILED = "failed"  # no kernel passed; the report is the only file
    NONE = "none"  # backward only: the candidate is forward-only
