"""The two engines of `kb generate`, both `Proposals` (generate.attempts): the rule engine's transfers and the LLM's answers.

- rule: each retrieved reference in rank order, each transfer strategy in `plan_strategies` order (lessons of
  earlier runs reorder it); the outcomes sent back change nothing.
- llm: rounds of one conversation with the configured model (generate.llm); each outcome goes back to the
  model as feedback. The prompt holds the spec, the top reference's IR, retrieved snippets and lessons.
"""

from __future__ import annotations

import time

from generate.attempts import Candidate, Failure, Proposals, plan_strategies
from generate.prompts import snippet_text, spec_summary
from generate.spec import Spec
from generate.stages import Stage
from generate.target import target_for
from generate.transfer import Target, transfer
from generate.transfer_serving import SERVING_STRATEGY, fits_layout, groups_heads, transfer_serving
from kb.errors import KBError
from kb.ir.text import parse_program, print_program
from kb.ir.validate import validate
from kb.store.kb import KnowledgeBase
from kb.store.models import Kernel, Lesson
from retrieve.hybrid import QueryResult
from verify.result import Verdict

__all__ = ["rule_candidates", "llm_candidates"]


def rule_candidates(kb: KnowledgeBase, spec: Spec, found: QueryResult, lessons: list[Lesson], name: str) -> Proposals:
    """Every (reference, strategy) pair in order; a transfer that fails is a candidate without a program."""
    target = target_for(spec)
    if spec.layout is not None:
        yield from _serving_candidates(kb, spec, found, target, name)
        return
    for ref in found.kernels:
        ref_program = parse_program(kb.get_row(Kernel, ref.id).ir_text)
        for strategy in plan_strategies(spec, ref, lessons):
            t0 = time.perf_counter()
            try:
                program = transfer(ref_program, target, strategy, name=name)
                validate(program)
            except KBError as err:
                yield Candidate(ref.id, strategy.value, None, "", time.perf_counter() - t0,
                                Failure(Stage.TRANSFER, Verdict.compile_error, str(err)))
                continue
            yield Candidate(ref.id, strategy.value, program, print_program(program), time.perf_counter() - t0)


def _serving_candidates(kb: KnowledgeBase, spec: Spec, found: QueryResult, target: Target, name: str) -> Proposals:
    """Each retrieved reference of the spec's layout transferred onto the spec (generate.transfer_serving); references
    of another layout (dense kernels retrieved for the variant) are passed over without an attempt."""
    assert spec.layout is not None
    fitting = [(ref, prog) for ref in found.kernels
               if fits_layout(prog := parse_program(kb.get_row(Kernel, ref.id).ir_text), spec.layout)]
    if spec.features.gqa_ratio > 1:  # a grouped tile reads each KV head's keys once, not once per query head
        fitting.sort(key=lambda rp: not groups_heads(rp[1]))
    if not fitting and found.kernels:
        yield Candidate(found.kernels[0].id, SERVING_STRATEGY, None, "", 0.0, Failure(
            Stage.TRANSFER, Verdict.compile_error, f"no retrieved reference is a {spec.layout.describe} program"))
    for ref, ref_program in fitting:
        t0 = time.perf_counter()
        try:
            program = transfer_serving(ref_program, spec.layout, target, sinks=spec.sinks, name=name,
                                       causal=spec.features.causal, derived=spec.derived_aux)
            validate(program)
        except KBError as err:
            yield Candidate(ref.id, SERVING_STRATEGY, None, "", time.perf_counter() - t0,
                            Failure(Stage.TRANSFER, Verdict.compile_error, str(err)))
            continue
        yield Candidate(ref.id, SERVING_STRATEGY, program, print_program(program), time.perf_counter() - t0)


def llm_candidates(kb: KnowledgeBase, spec: Spec, found: QueryResult, max_attempts: int) -> Proposals:
    """The LLM's answers for the spec; raises KBError at once when the LLM is not configured."""
    from generate.llm import LLMEngine  # noqa: PLC0415  openai loads only for --engine llm

    engine = LLMEngine(kb.settings)
    ref = found.kernels[0]
    reference_ir = kb.get_row(Kernel, ref.id).ir_text
    return engine.candidates(spec_summary(spec), reference_ir, [snippet_text(s) for s in found.snippets],
                             found.lessons, ref.id, max_attempts=max_attempts)
