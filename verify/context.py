"""Where one call of a verification session stands: the shape case, input distribution, seed and step.

A `Ctx` goes with every call of `verify.session.Session` and its backward half (`verify.backward.BackwardChecks`);
findings quote it (`[shape, distribution, seed N, step]`) so that a failure can be replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

from verify.result import ShapeCase

__all__ = ["Ctx"]


@dataclass(frozen=True)
class Ctx:
    case: ShapeCase | None  # None: the spec's own get_inputs()
    dist: str  # the input distribution's name ("-" before any inputs are drawn)
    seed: int
    step: str  # what this call is: "fresh inputs", "same storage, new values", "determinism rerun", ...
