"""Lessons written back after a generation run: what failed, what fixed it."""

from __future__ import annotations

from generate.attempts import AttemptOutcome
from generate.spec import Spec
from kb.store.models import Lesson

__all__ = ["lessons_for_run"]


def lessons_for_run(run_id: str, spec: Spec, outcomes: list[AttemptOutcome] | tuple[AttemptOutcome, ...],
                    succeeded: bool) -> list[Lesson]:
    """One lesson per distinct failed strategy, and one for the strategy that succeeded."""
    f = spec.features
    what = f"{f.mask} mask, {f.score_mod} score_mod{', split-KV decode' if f.split_kv or f.decode else ''}"
    out: list[Lesson] = []
    seen: set[str] = set()
    for o in outcomes:
        if o.passed or o.strategy in seen:
            continue
        seen.add(o.strategy)
        out.append(Lesson(run_id=run_id, kind=f"strategy_failed:{o.strategy}", features_json=f.to_json(),
                           text=f"For {what}: transfer strategy '{o.strategy}' from {o.reference_id} failed at "
                                f"{o.stage.value} ({o.verdict}): {o.feedback[:300]}"))
    if succeeded and outcomes:
        last = outcomes[-1]
        fixed = f" after {', '.join(sorted(seen))} failed" if seen else ""
        out.append(Lesson(run_id=run_id, kind=f"strategy_succeeded:{last.strategy}", features_json=f.to_json(),
                          text=f"For {what}: strategy '{last.strategy}' from {last.reference_id} passed verification{fixed}."))
    return out
