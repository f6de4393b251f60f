"""Lessons written back after a generation run: what failed, what fixed it.

Lessons are about kernels: which transfer strategy failed or passed for which kind of spec.
A failure that says nothing about the strategy writes no lesson, or every later spec with the
same features would try a good strategy last:
- the environment: the LLM service (refused connection, timeout, HTTP error), the verify
  harness process running out of time or memory (interpreter speed and machine load, not
  the kernel's meaning);
- the spec: refused before any attempt (`load_spec` raises, so there are no outcomes), or
  an attempt marked `Cause.SPEC`.
"""

from __future__ import annotations

from generate.attempts import AttemptOutcome, Cause
from generate.spec import Spec
from kb.store.models import Lesson
from verify.result import Verdict

__all__ = ["lessons_for_run", "failure_cause"]

# verify verdicts that are the harness process's fate, not a property of the kernel
_ENVIRONMENT_VERDICTS = {Verdict.timeout}


def failure_cause(o: AttemptOutcome) -> Cause:
    """Whose failure `o` is; `Cause.KERNEL` for passed outcomes too."""
    if o.cause is not Cause.KERNEL:
        return o.cause
    if o.verdict in _ENVIRONMENT_VERDICTS:
        return Cause.ENVIRONMENT
    if o.verdict is Verdict.runtime_error and "(memory limit" in o.feedback:
        return Cause.ENVIRONMENT
    return Cause.KERNEL


def lessons_for_run(run_id: str, spec: Spec, outcomes: list[AttemptOutcome] | tuple[AttemptOutcome, ...],
                    succeeded: bool) -> list[Lesson]:
    """One lesson per distinct strategy that failed on the kernel's account, and one for the strategy that succeeded."""
    f = spec.features
    what = f"{f.mask} mask, {f.score_mod} score_mod{', split-KV decode' if f.split_kv or f.decode else ''}"
    out: list[Lesson] = []
    seen: set[str] = set()
    for o in outcomes:
        if o.passed or o.strategy in seen or failure_cause(o) is not Cause.KERNEL:
            continue
        seen.add(o.strategy)
        out.append(Lesson(run_id=run_id, kind=f"strategy_failed:{o.strategy}", features_json=f.to_json(),
                           text=f"For {what}: transfer strategy '{o.strategy}' from {o.reference_id} failed at "
                                f"{o.stage.value} ({o.verdict.value}): {o.feedback[:300]}"))
    if succeeded and outcomes:
        last = outcomes[-1]
        fixed = f" after {', '.join(sorted(seen))} failed" if seen else ""
        out.append(Lesson(run_id=run_id, kind=f"strategy_succeeded:{last.strategy}", features_json=f.to_json(),
                          text=f"For {what}: strategy '{last.strategy}' from {last.reference_id} passed verification{fixed}."))
    return out
