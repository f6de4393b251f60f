"""One generation attempt: the candidate an engine proposes, its typed outcome, the IR check against the spec,
the rule engine's strategy planning.

An engine (generate.engines) is a generator of candidates, `Proposals`: it yields a `Candidate`, the pipeline
judges it (IR check, lowering, verification) and sends the attempt's `AttemptOutcome` back, which the engine
may use (the LLM engine returns it to the model as feedback) or not (the rule engine plans its order before
the first attempt). The pipeline stops asking at the first pass, at --max-attempts or when the spec's budget
is spent.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import asdict, dataclass
from enum import Enum

import torch

from generate.serving_bind import bind, program_inputs
from generate.spec import Spec, spec_inputs
from generate.spec_serving import ServingReference, dense_output
from generate.stages import Stage
from generate.transfer import STRATEGY_ORDER, Strategy
from kb.errors import KBError
from kb.features import Features
from kb.ir.expr import loaded_tensors
from kb.ir.interpret import run_program
from kb.ir.nodes import Program, Role
from kb.store.models import Lesson
from verify.result import Verdict

__all__ = ["Cause", "Failure", "Candidate", "AttemptOutcome", "Proposals", "check_program", "default_order",
           "plan_strategies", "IR_CHECK_TOL"]

# max |o - ref| allowed in the IR check: the interpreter computes in fp32 from the same inputs
IR_CHECK_TOL = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2}


class Cause(Enum):
    """Whose failure an attempt's is: only the kernel's teach something about kernels (generate.lessons)."""

    KERNEL = "kernel"  # the transferred program, its lowering or the strategy
    ENVIRONMENT = "environment"  # the LLM service, the verify harness process (timeout, memory limit)
    SPEC = "spec"  # the spec itself (an unsupported construct that slipped past tracing)


@dataclass(frozen=True)
class Failure:
    """Where a candidate stopped and why."""

    stage: Stage
    verdict: Verdict
    detail: str
    cause: Cause = Cause.KERNEL


@dataclass(frozen=True)
class Candidate:
    """A target program an engine proposes for one attempt, or why it could not make one."""

    reference_id: str  # the reference it was made from: the kernel's lineage parent
    strategy: str  # the rule strategy's value, or "llm"
    program: Program | None  # validated; None when `failure` says why there is none
    ir_text: str  # the program as proposed ("" when there is none)
    seconds: float  # spent making it (a transfer, an LLM request)
    failure: Failure | None = None
    untrusted: bool = False  # an LLM's program may break the interpreter in any way: what it raises is a failure


@dataclass(frozen=True)
class AttemptOutcome:
    n: int
    reference_id: str | None
    strategy: str  # rule strategy, or "llm"
    stage: Stage  # the last stage reached
    verdict: Verdict  # passed, or why the stage failed
    feedback: str
    seconds: float
    ir_text: str
    cause: Cause = Cause.KERNEL  # of a failure, as known where it happened (lessons classify further)

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.passed

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stage"] = self.stage.value
        d["verdict"] = self.verdict.value
        d["cause"] = self.cause.value
        d.pop("ir_text")
        return d


Proposals = Generator[Candidate, AttemptOutcome, None]  # an engine: yields candidates, is sent each one's outcome


def check_program(program: Program, spec: Spec, seed: int = 0) -> str | None:
    """Run `program` in the interpreter on the spec's inputs; None if it matches the spec's reference."""
    q, k, v = spec_inputs(spec, seed)
    inputs: dict = {"q": q, "k": k, "v": v, "sm_scale": spec.softmax_scale}
    args = spec.reference.args(q, k, v) if isinstance(spec.reference, ServingReference) else {}
    try:
        if spec.layout is not None:  # a serving program runs on the spec's own paged inputs holding q, k, v
            inputs |= program_inputs(bind(program, spec.layout), args)
    except KBError as err:
        return str(err)
    for p in program.params:
        if p.role is Role.AUX and p.name not in inputs:
            if p.name not in spec.aux:
                return f"program loads aux tensor {p.name!r} that the spec does not have"
            inputs[p.name] = spec.aux[p.name]
    try:
        out = run_program(program, inputs)["o"]
    except KBError as err:
        return f"interpreter error: {err}"
    if spec.layout is not None:
        out = dense_output(out, spec.layout, args)
    ref = spec.reference(q, k, v).float()
    if out.shape != ref.shape:
        return f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    if spec.layout is not None and spec.layout.kind == "chunked":  # rows past a sequence's chunk: NaN padding in both
        pad = torch.isnan(ref) & torch.isnan(out)
        out, ref = out.masked_fill(pad, 0.0), ref.masked_fill(pad, 0.0)
    abs_err = (out.float() - ref).abs()
    bad = torch.isnan(out).any().item()
    tol = IR_CHECK_TOL.get(spec.shapes.dtype, 1e-4) * max(1.0, ref.abs().max().item())
    if bad or abs_err.max().item() > tol:
        b, h, m, _ = (abs_err.nan_to_num(1e9) == abs_err.nan_to_num(1e9).max()).nonzero()[0].tolist()
        return (f"IR output differs from the spec reference: max abs err {abs_err.nan_to_num(float('inf')).max().item():.3g} "
                f"(tolerance {tol:.3g}) first at b={b}, h={h}, q row {m}; nan={bool(bad)}")
    return None


def _lesson_signature(f: Features) -> tuple[str, str, bool]:
    return (f.mask, f.score_mod, f.split_kv or f.decode)


def default_order(spec: Spec, reference_features: Features | None) -> list[Strategy]:
    """The order a transfer tries KV-loop strategies in, before any lesson.

    - masks that read aux tensors (documents, block-sparse, per-batch prefixes) can only skip
      blocks at run time: BLOCK_MASK first (it skips empty blocks, FlexAttention-style);
    - a mask of another kind than the reference's: DERIVE first (bounds from the target mask);
    - otherwise REUSE first: the reference's own loop bounds, the most faithful transfer.
    """
    mask = spec.mask_mod
    if mask is not None and loaded_tensors(mask):
        return [Strategy.BLOCK_MASK, Strategy.DERIVE, Strategy.REUSE]
    if reference_features is not None and reference_features.mask != spec.features.mask:
        return [Strategy.DERIVE, Strategy.REUSE, Strategy.BLOCK_MASK]
    return list(STRATEGY_ORDER)


def plan_strategies(spec: Spec, reference: object, lessons: list[Lesson]) -> list[Strategy]:
    """Strategy order for one reference: `default_order`, reordered by lessons for the same kind of spec.

    A lesson `strategy_succeeded:<s>` for the same (mask, score, decode) moves <s> first;
    `strategy_failed:<s>` moves <s> last.
    """
    base = default_order(spec, getattr(reference, "features", None))
    sig = _lesson_signature(spec.features)
    good: list[Strategy] = []
    bad: list[Strategy] = []
    for les in lessons:
        if _lesson_signature(Features.from_json(les.features_json or "{}")) != sig:
            continue
        outcome, _, name = les.kind.partition(":")
        try:
            s = Strategy(name)
        except ValueError:
            continue
        (good if outcome == "strategy_succeeded" else bad).append(s)
    order = [s for s in base if s in good] + [s for s in base if s not in good and s not in bad]
    return order + [s for s in base if s in bad and s not in good]
