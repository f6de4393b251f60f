"""The LLM engine inside the generation pipeline: prompt from retrieval, check by the interpreter."""

from __future__ import annotations

from collections.abc import Callable

from generate.attempts import AttemptOutcome, Cause
from generate.llm import LLMAttempt, LLMEngine, LLMServiceError
from generate.llm import Stage as LLMStage
from generate.prompts import snippet_text, spec_summary
from generate.spec import Spec
from generate.stages import Stage
from kb.ir.nodes import Program
from kb.store.kb import KnowledgeBase
from retrieve.hybrid import QueryResult, RankedKernel
from verify.result import Verdict

__all__ = ["llm_transfer"]

_STAGE = {LLMStage.PARSE: Stage.TRANSFER, LLMStage.VALIDATE: Stage.TRANSFER, LLMStage.CHECK: Stage.IR_CHECK,
          LLMStage.PASSED: Stage.IR_CHECK}
_VERDICT = {LLMStage.PARSE: Verdict.compile_error, LLMStage.VALIDATE: Verdict.compile_error,
            LLMStage.CHECK: Verdict.numeric_mismatch, LLMStage.PASSED: Verdict.passed}


def _outcome(a: LLMAttempt, ref: RankedKernel) -> AttemptOutcome:
    return AttemptOutcome(a.n, ref.id, "llm", _STAGE[a.stage], _VERDICT[a.stage], a.error or "", a.seconds, a.ir_text)


def llm_transfer(kb: KnowledgeBase, spec: Spec, ref: RankedKernel, found: QueryResult, max_attempts: int,
                 check: Callable[[Program], str | None]) -> tuple[list[AttemptOutcome], Program | None, RankedKernel | None]:
    """Ask the configured LLM for the target program; `check` runs every later stage (None = passed).

    Service errors (connection refused, timeout, HTTP errors) end the run as a failed attempt whose
    cause is the environment, not the kernel (no lesson is drawn from it); the answers received
    before are kept."""
    engine = LLMEngine(kb.settings)
    reference_ir = kb.get(ref.id).ir_text  # type: ignore[union-attr]
    try:
        res = engine.transfer(spec_summary(spec), reference_ir, [snippet_text(s) for s in found.snippets],
                              found.lessons, check, max_attempts=max_attempts)
    except LLMServiceError as err:
        outcomes = [_outcome(a, ref) for a in err.attempts]
        outcomes.append(AttemptOutcome(len(outcomes) + 1, ref.id, "llm", Stage.TRANSFER, Verdict.runtime_error, str(err), 0.0, "",
                                       Cause.ENVIRONMENT))
        return outcomes, None, None
    outcomes = [_outcome(a, ref) for a in res.attempts]
    return outcomes, res.program, ref if res.program is not None else None
