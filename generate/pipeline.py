"""`generate(kb, spec_path, options)`: spec -> retrieve -> transfer -> check IR -> lower -> verify -> write back.

Attempts are the candidates of one engine (generate.engines): (reference, strategy) pairs for the
rule engine, LLM rounds for the LLM engine; each is judged the same way and its outcome sent back to
the engine. Each attempt stops at the first failing stage; its verdict and feedback are kept.
On success the kernel (with lineage: parent = reference), its sources, the attempts, the
run and the lessons are written in ONE transaction; on failure the run, attempts and lessons
are written, and no kernel. Lineage is append-only: a run whose program is already in the KB
links to that kernel and changes nothing about it. With memory off, retrieval ignores
generated kernels and lessons. The files in `--out` are published as one set at the end of
the run (generate.outputs), with a report whose `status` says what they are.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import torch

from generate.attempts import AttemptOutcome, Candidate, Failure, Proposals, check_program
from generate.backward import BackwardBuilt, build_backward, learnable_aux, lowering, run_to_run
from generate.candidate import write_candidate
from generate.cuda_compile import NOT_COMPILED, CudaCompile, compile_cuda
from generate.cuda_design import (
    CUDA_LOWERINGS, CudaChoice, CudaPair, CudaPlan, choose_cuda, cuda_pairs, cuda_plan, forward_dispatch, with_backward,
)
from generate.designs import design_table
from generate.engines import llm_candidates, rule_candidates
from generate.outputs import OutputError, output_stem, publish, staging_dir, write_error
from generate.lessons import lessons_for_run
from generate.spec import Spec, load_spec
from generate.spec_cache import TracedSpec, remember_trace
from generate.serving_bind import bind
from generate.stages import ReportStatus, Stage
from generate.watchdog import BudgetSpent, watchdog
from kb.errors import KBError
from sqlalchemy.exc import SQLAlchemyError
from kb.ir.design import DesignTable, arch_of_capability, head_bucket
from kb.ir.features import derive_features
from kb.ir.nodes import Program
from kb.ir.text import content_hash, print_program
from kb.lower.cuda_dispatch import CudaDispatch
from kb.lower.triton import lower_program
from kb.lower.triton_op import with_backward_reason
from kb.procs import Owner
from kb.store.kb import KnowledgeBase
from kb.store.models import Attempt, GenerationRun, Kernel, Lesson, RunStatus, Tunable
from kb.store.records import assign_id
from retrieve.hybrid import Filters, describe_target, query
from verify import VerifyOptions, verify
from verify.result import Verdict

__all__ = ["FromCache", "GenerateOptions", "GenerateResult", "generate"]

log = logging.getLogger(__name__)
Engine = Literal["rule", "llm"]


@dataclass(frozen=True)
class GenerateOptions:
    engine: Engine = "rule"
    memory: bool = True
    out_dir: Path | None = None
    max_attempts: int = 6
    references: int = 3  # top-k references the rule engine may try
    verify_kernel: bool = True  # run the verify harness on the lowered Triton candidate
    verify_distributions: tuple[str, ...] = ("normal", "adversarial")
    verify_max_cases: int = 3
    compile_cuda: bool = True  # nvcc-compile the CUDA lowering (object only) and report the result
    timeout_s: float = 600.0  # ONE budget (s) for a spec's attempts (--timeout, KB_VERIFY_TIMEOUT); each verify gets what is left
    deadline: float | None = None  # time.monotonic() when that budget ends; generate() sets it per spec
    target: str = "auto"  # GPU arch to design for (sm90, sm80, ...); auto: this machine's GPU, else the setting
    designs: DesignTable | None = None  # {arch: {head-dim bucket: designs}}; generate() chooses them per spec from the KB
    cuda: CudaPlan | None = None  # target arch, head dim and FA2 traits of the `.cu`; generate() sets them
    # measured `.cu` beside Triton on the target arch, per CUDA lowering: where the `.cu` runs; generate() reads them
    cuda_pairs: dict[str, list[CudaPair]] | None = None
    backward: bool = True  # also generate the backward (dq, dk, dv) and make ModelNew differentiable (--no-backward)
    deterministic: bool = False  # only a backward whose gradients are bitwise reproducible run to run (--deterministic)


@dataclass(frozen=True)
class FromCache:
    """A result served from the generate cache (generate.cache): which run made its files, under which key."""

    run_id: str  # the run that generated and verified the files
    key: str  # the cache key (sha256 hex)


@dataclass(frozen=True)
class GenerateResult:
    spec_path: Path
    run_id: str
    succeeded: bool
    kernel_id: str | None
    attempts: tuple[AttemptOutcome, ...]
    files: dict[str, Path] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0
    status: ReportStatus = ReportStatus.FAILED  # the report's status
    backward: ReportStatus = ReportStatus.NONE  # the report's backward status: verified, generated, not verified or none
    backward_reason: str = ""  # why there is no backward, when there is none
    cached: FromCache | None = None  # set when the files came from the cache: no attempt ran, no run was recorded

    @property
    def attempts_to_success(self) -> int | None:
        return len(self.attempts) if self.succeeded else None


def _refused(kb: KnowledgeBase, run: GenerationRun, out_dir: Path, error: str, message: str, t0: float) -> GenerateResult:
    """A run that stops before any attempt (a spec error, a spec generation does not support yet): recorded
    as failed, no lesson (nothing about kernels was learnt); the spec's earlier files go and a report says why."""
    spec_path = Path(run.spec_path)
    run.status, run.error, run.finished_at = RunStatus.FAILED.value, error, _now()
    run_id = kb.write_run(run)
    files = publish(out_dir, output_stem(spec_path), {}, {"status": ReportStatus.FAILED.value, "spec": str(spec_path), "run_id": run_id,
                                                         "kernel_id": None, "error": run.error, "attempts": []})
    return GenerateResult(spec_path, run_id, False, None, (), files, message, time.perf_counter() - t0)


def _now() -> datetime:
    return datetime.now(timezone.utc)


_SERVING_LOOKAHEAD = 4


def _not_transferred(spec: Spec) -> str | None:
    """Why no kernel is generated for `spec` (traced forms no transfer writes yet), or None."""
    if spec.sink is not None and spec.layout is None:
        return ("generation for dense specs with attention sinks is not supported yet (paged and token-pool decode "
                "specs with sinks are): the dense transfer does not start the online softmax at the sink (m = sink, "
                "l = 1; docs/ir.md); `kb query SPEC` ranks references for it")
    return None


def generate(kb: KnowledgeBase, spec_path: Path, options: GenerateOptions = GenerateOptions(), *,
             run_id: str = "") -> GenerateResult:
    """Generate a verified kernel for one spec; never raises for kernel failures (they are results). `run_id`: the
    id its run is recorded under (a campaign's driver names it, to mark the run if the worker dies); empty: a new one."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + options.timeout_s  # one budget: the spec's import and tracing, then the attempts
    spec_path = Path(spec_path)
    run = GenerationRun(id=run_id, spec_path=str(spec_path), engine=options.engine, memory=options.memory)
    out_dir = options.out_dir or (Path.cwd() / "out")
    try:
        with watchdog(options.timeout_s, f"importing and tracing spec {spec_path}"):
            spec = load_spec(spec_path)
    except KBError as err:
        return _refused(kb, run, out_dir, f"{Stage.SPEC.value}: {err}", str(err), t0)
    remember_trace(spec_path, TracedSpec(spec.features, *spec.variant_strings()), kb.settings.cache_dir)
    if (why := _not_transferred(spec)) is not None:  # before any attempt: a kernel would miss what the spec computes
        run.spec_hash = spec.source_hash
        return _refused(kb, run, out_dir, why, why, t0)
    run.spec_hash = spec.source_hash
    run.error = Owner.current().note  # while running: its process, so `kb doctor` can tell a run whose process died
    run_id = kb.write_run(run)
    run = kb.get_row(GenerationRun, run_id)
    run.error = ""  # the run's final write replaces the owner note
    options = replace(options, deadline=deadline,
                      designs=options.designs if options.designs is not None else _designs(kb, spec, options),
                      cuda=options.cuda or cuda_plan(resolve_target(options.target, kb.settings.target_arch),
                                                     spec.shapes.D, kb.usable(Tunable, family="fa2_cuda")))
    if options.cuda_pairs is None:
        target = options.cuda.target if options.cuda else resolve_target(options.target, kb.settings.target_arch)
        options = replace(options, cuda_pairs={lowering: cuda_pairs(kb, target, lowering) if options.memory else []
                                               for lowering in CUDA_LOWERINGS})
    with staging_dir(out_dir) as stage:
        bwd: tuple[BackwardBuilt, list[AttemptOutcome]] | _NoBackward
        bwd = _NoBackward("not run: the forward kernel did not pass" if options.backward else "not asked (--no-backward)")
        if spec.layout is not None:
            bwd = _NoBackward(f"not built: {spec.layout.describe} kernels are forward only (serving)")
        try:
            # the spec's own code (its reference, in every IR check) runs in this process: bounded by the budget, with
            # a grace period so that the verifier child's own timeout, at the same deadline, reports first
            with watchdog(_budget_left(options) + _GRACE_S, f"generating for spec {spec_path}"):
                outcomes, built, ref = _attempts(kb, spec, options, stage)
                if built is not None and options.backward and spec.layout is None:  # a BudgetSpent in there is the backward's reason
                    bwd = _backward(kb, spec, built, options, stage, len(outcomes) + 1)
                    if not isinstance(bwd, _NoBackward) and bwd[0].cuda_runs:
                        built = replace(built, cuda_src=bwd[0].cuda_src or built.cuda_src,
                                        cuda_report={**built.cuda_report, "backward_runs": bwd[0].cuda_runs})
            if built is not None:  # after the backward, whose verification shares the spec's budget
                built = _compile_cuda(spec, built, options)
        except KBError as err:  # e.g. no reference in the KB, LLM not configured: the run is recorded as failed
            outcomes, built, ref = [], None, None
            run.error = str(err)
        except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM (the CLI maps it): record the run, write no kernel
            run.status, run.error, run.finished_at = RunStatus.INTERRUPTED.value, "interrupted (Ctrl-C or SIGTERM) before a kernel was verified", _now()
            kb.write_run(run)
            raise KeyboardInterrupt(f"run {run.id} recorded as interrupted; no kernel written") from err
        return _finish(kb, spec, run, outcomes, built, ref, bwd, options, t0, out_dir)


@dataclass(frozen=True)
class _Built:
    """A program that passed every stage, with what was written for it."""

    program: Program
    triton_src: str
    cuda_src: str | None
    files: dict[str, Path]
    verdict: Verdict  # passed, or not_run (--no-verify)
    detail: str
    cuda_report: dict = field(default_factory=dict)  # which CUDA lowering, its traits, where the `.cu` runs and why
    cuda_build: CudaCompile = NOT_COMPILED  # nvcc on the `.cu`, before the write-back
    dispatch: CudaDispatch | None = None  # where the module runs the `.cu` instead of its Triton kernels


def _compile_cuda(spec: Spec, built: _Built, options: GenerateOptions) -> _Built:
    if not (built.cuda_src and options.compile_cuda):
        return built
    log.info("%s: %s", Stage.COMPILE_CUDA.value, spec.path)
    return replace(built, cuda_build=compile_cuda(built.cuda_src, built.files["candidate"].parent, spec.shapes.D,
                                                  spec.shapes.Dv if spec.shapes.value_dim else None,
                                                  arch=built.cuda_report.get("arch", "sm_90")))


@dataclass
class _NoBackward:
    """Why the run has no backward (the forward-only candidate stays), with the attempts made."""

    reason: str
    outcomes: list[AttemptOutcome] = field(default_factory=list)


def _backward(kb: KnowledgeBase, spec: Spec, built: _Built, options: GenerateOptions, stage: Path,
              first_n: int) -> tuple[BackwardBuilt, list[AttemptOutcome]] | _NoBackward:
    try:
        found, outcomes = build_backward(
            kb, spec, built.program, memory=options.memory, references=options.references,
            verify_fn=lambda cand: _verify(spec, cand, options, backward=True) if options.verify_kernel else
            (Verdict.not_run, "kernel verification skipped (--no-verify)"),
            designs=(options.designs, lambda structure: _designs(kb, spec, options, backward=True, structure=structure)),
            stage=stage, stem=_name(spec),
            first_n=first_n, deterministic=options.deterministic,
            cuda=lambda program: _with_backward(spec, built, program, options))
    except OutputError:
        raise  # the run fails here: no attempt can write its files
    except KBError as err:
        return _NoBackward(str(err))
    if found is None:
        last = outcomes[-1] if outcomes else None
        return _NoBackward(f"no backward passed: {last.stage.value} {last.verdict.value}: {last.feedback[:300]}" if last
                           else "no backward reference could be tried", outcomes)
    return found, outcomes


def _with_backward(spec: Spec, built: _Built, bwd: Program, options: GenerateOptions) -> tuple[CudaDispatch | None, str]:
    """The forward's CUDA dispatch for the module that also holds backward program `bwd`: with the Hopper backward in the
    `.cu` where it applies (never with --deterministic: it adds dq's partials in the order they arrive), and the
    report's sentence."""
    if options.deterministic:
        return built.dispatch, ("backward()'s Triton kernels run: --deterministic (the Hopper backward adds dq's partials "
                                "in the order they arrive)")
    target = options.cuda.target if options.cuda else resolve_target(options.target, "sm90")
    pairs = (options.cuda_pairs or {}).get("sm90_wgmma", [])
    return with_backward(built.dispatch, built.program, bwd, target, spec.shapes.D, pairs,
                         derive_features(bwd, shapes=_shape_dict(spec)))


def _attempts(kb: KnowledgeBase, spec: Spec, options: GenerateOptions,
              stage: Path) -> tuple[list[AttemptOutcome], _Built | None, str | None]:
    """Judge the engine's candidates in turn; (every outcome, what passed, the id of its reference)."""
    text = describe_target(spec.features, *spec.variant_strings())
    # a serving spec transfers only references of its own layout (generate.engines): dense kernels that rank high for
    # its variant are passed over, so it looks further down the ranking
    k = options.references * _SERVING_LOOKAHEAD if spec.layout is not None else options.references
    found = query(kb, text, spec.features, k=k, filters=Filters(memory=options.memory))
    if not found.kernels:
        raise KBError("the KB holds no executable reference program; run `kb ingest --all` first")
    if options.engine == "llm":
        proposals = llm_candidates(kb, spec, found, options.max_attempts)
    else:
        proposals = rule_candidates(kb, spec, found, _strategy_lessons(kb) if options.memory else [], _name(spec))
    outcomes: list[AttemptOutcome] = []
    while len(outcomes) < options.max_attempts:
        if outcomes and _budget_left(options) <= 0:
            return _budget_spent(outcomes, options), None, None
        cand = _next(proposals, outcomes[-1] if outcomes else None)
        if cand is None:
            break
        try:
            outcome, built = _try(spec, cand, len(outcomes) + 1, options, stage)
        except BudgetSpent as err:  # the watchdog: the attempt is recorded as the one the budget ran out in
            outcomes.append(AttemptOutcome(len(outcomes) + 1, cand.reference_id, cand.strategy, Stage.IR_CHECK,
                                           Verdict.timeout, str(err), 0.0, cand.ir_text))
            return outcomes, None, None
        outcomes.append(outcome)
        if built is not None:
            return outcomes, built, cand.reference_id
    return outcomes, None, None


def _next(proposals: Proposals, last: AttemptOutcome | None) -> Candidate | None:
    """The engine's next candidate, told how its last one did; None when it has no more."""
    try:
        return next(proposals) if last is None else proposals.send(last)
    except StopIteration:
        return None


def _try(spec: Spec, cand: Candidate, n: int, options: GenerateOptions,
         stage: Path) -> tuple[AttemptOutcome, _Built | None]:
    t0 = time.perf_counter()
    result = cand.failure if cand.program is None else _judge(spec, cand.program, cand.untrusted, options, stage)
    assert result is not None, "a candidate without a program carries its failure"
    seconds = cand.seconds + time.perf_counter() - t0
    if isinstance(result, Failure):
        return AttemptOutcome(n, cand.reference_id, cand.strategy, result.stage, result.verdict, result.detail, seconds,
                              cand.ir_text, result.cause), None
    return AttemptOutcome(n, cand.reference_id, cand.strategy, Stage.VERIFY if options.verify_kernel else Stage.LOWER,
                          Verdict.passed, result.detail, seconds, cand.ir_text), result


def _judge(spec: Spec, program: Program, untrusted: bool, options: GenerateOptions, stage: Path) -> _Built | Failure:
    """The IR check, then lowering and verification; what an untrusted program raises is its failure."""
    program = replace(program, name=_name(spec))
    try:
        failure = check_program(program, spec)
        if failure:
            return Failure(Stage.IR_CHECK, Verdict.numeric_mismatch, failure)
        return _realise(spec, program, options, stage)
    except Exception as err:
        if not untrusted:
            raise
        log.debug("judging an untrusted program raised", exc_info=True)
        return Failure(Stage.IR_CHECK, Verdict.runtime_error, f"running the program raised {type(err).__name__}: {err}")


def _strategy_lessons(kb: KnowledgeBase) -> list[Lesson]:
    return [les for les in kb.usable(Lesson) if les.kind.startswith("strategy_")]


def _name(spec: Spec) -> str:
    return output_stem(spec.path)


def _finish(kb: KnowledgeBase, spec: Spec, run: GenerationRun, outcomes: list[AttemptOutcome], built: _Built | None,
            ref: str | None, bwd: tuple[BackwardBuilt, list[AttemptOutcome]] | _NoBackward,
            options: GenerateOptions, t0: float, out_dir: Path) -> GenerateResult:
    """Write back and publish. An I/O failure (a full disk) fails the run with one line saying what was kept: the
    verified kernel stays in the KB when only --out failed, its files are published when only the KB failed."""
    kernel = _kernel_row(spec, built, ref) if built is not None and ref is not None else None
    files: dict[str, Path] = {}
    if built is not None:
        try:
            files = _stage_outputs(spec, built, bwd)
        except OutputError as err:
            run.error = f"{err}; nothing was published to {out_dir}"
    succeeded = kernel is not None and not run.error
    run.status = (RunStatus.SUCCEEDED if succeeded else RunStatus.FAILED).value
    run.finished_at = _now()
    if kernel is None and not run.error:
        run.error = outcomes[-1].feedback[:2000] if outcomes else "no attempt was possible"
    records: list = []
    existing = None
    if kernel is not None:
        assign_id(kernel)
        existing = kb.find(kernel.id)  # the same program again: link the run to it; its lineage stays as written
        if existing is None:
            records.append(kernel)
        run.kernel_id = kernel.id
    records.append(run)
    bwd_outcomes = bwd.outcomes if isinstance(bwd, _NoBackward) else bwd[1]
    records += [Attempt(run_id=run.id, n=o.n, reference_id=o.reference_id, ir_text=o.ir_text, verdict=o.verdict.value,
                        feedback=f"[{o.stage.value}/{o.strategy}] {o.feedback}"[:4000], duration_s=o.seconds)
                for o in outcomes + bwd_outcomes]
    records += lessons_for_run(run.id, spec, outcomes, succeeded)
    bwd_kernel, bwd_existing = None, None
    if kernel is not None and not isinstance(bwd, _NoBackward):
        bwd_kernel = _backward_row(spec, bwd[0], kernel)
        assign_id(bwd_kernel)
        bwd_existing = kb.find(bwd_kernel.id)
        if bwd_existing is None:
            records.append(bwd_kernel)
    stored = _store(kb, records, run)
    if kernel is not None and files and stored is None:
        run.error = f"kernel {kernel.id} was verified, but {run.error or 'the KB write failed'}; the files are in {out_dir}"
    report = _report(spec, run, kernel, existing, built, ref, outcomes, options)
    if built is not None and not files:  # verified, but its files could not be staged: nothing is published
        report["status"] = ReportStatus.FAILED.value
    if built is not None:
        report["backward"] = _backward_report(bwd, bwd_kernel, bwd_existing)
    try:
        published = publish(out_dir, _name(spec), files, report)
    except OutputError as err:  # the KB holds what was verified; only the files are missing
        kept = f"kernel {kernel.id} is kept in the KB (kb show {kernel.id})" if kernel is not None and stored else "nothing"
        run.error = f"{err}; no file was published to {out_dir}; {kept}"
        run.status = RunStatus.FAILED.value
        _store(kb, [run], run)
        published, report["status"] = {}, ReportStatus.FAILED.value
    back = report.get("backward", {})
    return GenerateResult(spec.path, run.id, run.status == RunStatus.SUCCEEDED.value, kernel.id if kernel else None,
                          tuple(outcomes), published, run.error, time.perf_counter() - t0,
                          ReportStatus(report["status"]), ReportStatus(back.get("status", ReportStatus.NONE)),
                          back.get("reason", ""))


def _stage_outputs(spec: Spec, built: _Built, bwd: tuple[BackwardBuilt, list[AttemptOutcome]] | _NoBackward) -> dict[str, Path]:
    """The files of a built kernel in the staging directory, by kind: the forward-only candidate with NO_BACKWARD saying
    why, or the differentiable one; the IR (and the backward's), the `.cu`. OutputError when one cannot be written."""
    files = dict(built.files)
    try:
        if isinstance(bwd, _NoBackward):
            for kind in ("candidate", "triton"):
                files[kind].write_text(with_backward_reason(files[kind].read_text(), f"kb generate built none: {bwd.reason}"))
        else:
            bf = bwd[0].files  # the differentiable candidate replaces the forward-only one
            files.update({"candidate": bf.candidate, "triton": bf.triton, **({"aux": bf.aux} if bf.aux else {})})
            files["backward_ir"] = _stage_text(bf.candidate.with_name(bf.candidate.stem + "_bwd.kbir"),
                                               print_program(bwd[0].program))
        files["ir"] = _stage_text(files["candidate"].with_suffix(".kbir"), print_program(built.program))
        if built.cuda_src:
            files["cuda"] = _stage_text(files["candidate"].with_suffix(".cu"), built.cuda_src)
    except OSError as err:
        raise write_error(files["candidate"].parent, err) from None
    return files


def _store(kb: KnowledgeBase, records: list, run: GenerationRun) -> list[str] | None:
    """Write `records` in one transaction; None when the KB cannot be written (a full disk): the run's error says so,
    and the run itself is marked failed where the KB still takes that one row, else `kb doctor --fix` will."""
    try:
        return kb.write_records(records)
    except (KBError, SQLAlchemyError, OSError) as err:
        why = f"the KB could not be written ({_one_line(err)}), nothing of this run was stored in it"
        run.error = f"{run.error}; {why}" if run.error else why
        run.status = RunStatus.FAILED.value
        if run.kernel_id is not None and kb.find(run.kernel_id) is None:
            run.kernel_id = None  # its kernel row did not go in; the error names it
        try:
            kb.write_run(run)
        except (KBError, SQLAlchemyError, OSError):
            run.error += f"; run {run.id} stays 'running' until `kb doctor --fix` marks it interrupted"
        return None


def _one_line(err: BaseException) -> str:
    text = str(getattr(err, "orig", None) or err)
    return text.splitlines()[0] if text else type(err).__name__


def _stage_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _report(spec: Spec, run: GenerationRun, kernel: Kernel | None, existing: object, built: _Built | None,
            ref: str | None, outcomes: list[AttemptOutcome], options: GenerateOptions) -> dict:
    """What this run produced, in words a user reads first: `status` is the truth about the files beside it."""
    if built is None:
        status = ReportStatus.FAILED
    elif built.verdict is Verdict.passed:
        status = ReportStatus.VERIFIED
    else:
        status = ReportStatus.UNVERIFIED
    report: dict[str, object]
    report = {"status": status.value, "spec": str(spec.path), "run_id": run.id, "kernel_id": kernel.id if kernel else None,
              "kernel_was_in_kb": existing is not None, "reference_id": ref,
              "engine": options.engine, "memory": options.memory, "features": spec.features.to_json(),
              "attempts": [o.as_dict() for o in outcomes], "error": run.error or None,
              "designs": {arch: {str(b): [str(d) for d in ds] for b, ds in by.items()}
                          for arch, by in (options.designs or {}).items()},
              "design_choice": "first listed that fits (--deterministic)" if options.deterministic else
              "the fastest listed design that fits, timed at the first call per shape bucket (KB_DESIGN_TIMING=0: "
              "the first that fits)"}
    if built is not None:
        report["verify"] = {"verdict": built.verdict.value, "detail": built.detail}
        report["ir_hash"] = content_hash(built.program)
        report["cuda"] = {**built.cuda_report, **built.cuda_build.as_dict()}
    return report


def _backward_report(bwd: tuple[BackwardBuilt, list[AttemptOutcome]] | _NoBackward, row: Kernel | None,
                     existing: object) -> dict:
    """The report's `backward` section: whether ModelNew is differentiable, and why (not)."""
    if isinstance(bwd, _NoBackward):
        return {"status": ReportStatus.NONE.value, "reason": bwd.reason, "attempts": [o.as_dict() for o in bwd.outcomes]}
    built, outcomes = bwd
    status = ReportStatus.VERIFIED if built.verdict is Verdict.passed else ReportStatus.UNVERIFIED
    why = run_to_run(built)
    return {"status": status.value,
            "kernel_id": row.id if row else None, "kernel_was_in_kb": existing is not None,
            "reference_id": built.reference_id, "ir_hash": content_hash(built.program),
            "deterministic": why is None, **({"nondeterministic_because": why} if why else {}),
            "verify": {"verdict": built.verdict.value, "detail": built.detail}, "attempts": [o.as_dict() for o in outcomes]}


def _backward_row(spec: Spec, built: BackwardBuilt, forward: Kernel) -> Kernel:
    """The backward program as a KB kernel: lineage from its backward reference; its file is the whole module."""
    feats = derive_features(built.program, shapes=_shape_dict(spec))
    return Kernel(name=built.program.name, family="generated", origin="generated", ir_text=print_program(built.program),
                  features_json=feats.to_json(), arch="any", dtype=spec.shapes.dtype, head_dim=spec.shapes.D,
                  verified=built.verdict is Verdict.passed, verify_note=f"verify (with gradients): {built.verdict.value}; "
                  f"forward kernel {forward.id}", spec_hash=spec.source_hash, triton_src=built.module_src, cuda_src="",
                  file=str(spec.path), parent_id=built.reference_id)


def _kernel_row(spec: Spec, built: _Built, ref: str) -> Kernel:
    feats = derive_features(built.program, shapes=_shape_dict(spec))
    return Kernel(name=built.program.name, family="generated", origin="generated", ir_text=print_program(built.program),
                  features_json=feats.to_json(), arch="any", dtype=spec.shapes.dtype, head_dim=spec.shapes.D,
                  verified=built.verdict is Verdict.passed, verify_note=_verify_note(built), spec_hash=spec.source_hash,
                  triton_src=built.triton_src, cuda_src=built.cuda_src or "", file=str(spec.path), parent_id=ref)


def _verify_note(built: _Built) -> str:
    """`verify: passed`, and what nvcc said when there is a `.cu` (`compile_cuda: ok`)."""
    note = f"{Stage.VERIFY.value}: {built.verdict.value}"
    return f"{note}; {Stage.COMPILE_CUDA.value}: {built.cuda_build.status}" if built.cuda_src else note


def _realise(spec: Spec, program: Program, options: GenerateOptions, stage: Path) -> _Built | Failure:
    """Lower to Triton (+ CUDA), write the candidate into the staging directory, verify it."""
    plan = options.cuda or cuda_plan(resolve_target(options.target, "sm90"), spec.shapes.D, [])
    cuda = choose_cuda(program, plan) if spec.layout is None else None  # the CUDA lowerings take no serving layout
    dispatch, runs = _dispatch(spec, program, cuda, plan, options)
    try:
        triton_src = lower_program(program, lowering(options.deterministic), designs=options.designs, cuda=dispatch)
    except KBError as err:
        return Failure(Stage.LOWER, Verdict.compile_error, str(err))
    aux = [p.name for p in program.params if p.role.value == "aux"]
    try:
        serving = bind(program, spec.layout) if spec.layout is not None else None
        cand = write_candidate(spec, triton_src, aux, stage, _name(spec), serving)
    except OutputError:
        raise  # the run fails here: no attempt can write its files
    except KBError as err:
        return Failure(Stage.LOWER, Verdict.compile_error, str(err))
    verdict, detail = Verdict.not_run, "kernel verification skipped (--no-verify)"
    if options.verify_kernel:
        verdict, detail = _verify(spec, cand.candidate, options)
        if verdict is not Verdict.passed:
            return Failure(Stage.VERIFY, verdict, detail)
    files = {"candidate": cand.candidate, "triton": cand.triton, **({"aux": cand.aux} if cand.aux else {})}
    return _Built(program, triton_src, cuda.source if cuda else None, files, verdict, detail,
                  {**cuda.report, "runs": runs} if cuda else {}, dispatch=dispatch)


def _dispatch(spec: Spec, program: Program, cuda: CudaChoice | None, plan: CudaPlan,
              options: GenerateOptions) -> tuple[CudaDispatch | None, str]:
    """Where the module runs its `.cu` (measured faster for this kernel or kernels like it, on the target arch and
    the spec's head dim), and the report's sentence saying which implementation runs there and why."""
    if cuda is None:
        return None, "the Triton module (no CUDA lowering)"
    bucket = head_bucket(spec.shapes.D)
    pairs = [p for p in (options.cuda_pairs or {}).get(cuda.lowering, []) if not p.features.backward]
    features = derive_features(program, shapes=_shape_dict(spec))
    faster, why = forward_dispatch(pairs, features, bucket, "k-" + content_hash(program)[:16])
    runs = f"{why} (on {plan.target}, head dim {bucket})"
    # a dispatch listing nothing still carries the `.cu`, which the backward may extend (generate.cuda_design.with_backward)
    return CudaDispatch(f"{_name(spec)}.cu", cuda.source, cuda.arch, {plan.target: {bucket: why}} if faster else {}), runs


def _shape_dict(spec: Spec) -> dict[str, int]:
    s = spec.shapes
    return {"B": s.B, "Hq": s.Hq, "Hkv": s.Hkv, "M": s.M, "N": s.N, "D": s.D}


def resolve_target(target: str, default: str) -> str:
    """`auto`: this machine's GPU if it has one, else `default` (the KB_TARGET_ARCH setting)."""
    if target != "auto":
        if not target.startswith("sm") or not target[2:].isdigit():
            raise KBError(f"unknown --target {target!r}; use auto or an arch such as sm90, sm80")
        return target
    if torch.cuda.is_available():
        return arch_of_capability(torch.cuda.get_device_capability())
    return default


def _designs(kb: KnowledgeBase, spec: Spec, options: GenerateOptions, *, backward: bool = False,
             structure: str | None = None) -> DesignTable:
    """The designs the emitted module carries: the target arch first, sm80/sm90 beside it, for the spec's
    head-dim bucket and the common 64/128 buckets, ranked by what the KB knows (measured sweeps with memory on);
    `backward`: those of its backward kernels, of dq structure `structure` (generate.designs.backward_structure)."""
    target = resolve_target(options.target, kb.settings.target_arch)
    archs = list(dict.fromkeys([target, "sm90", "sm80"]))
    buckets = sorted({head_bucket(spec.shapes.D), 64, 128})
    value_bucket = head_bucket(spec.shapes.Dv) if spec.shapes.value_dim else None
    features = replace(spec.features, backward=True, learned_table=bool(learnable_aux(spec))) if backward \
        else spec.features
    return design_table(kb, features, archs, buckets, memory=options.memory, value_bucket=value_bucket,
                        structure=structure)


_GRACE_S = 5.0  # the watchdog fires this long after the spec's deadline (see generate())


def _budget_left(options: GenerateOptions) -> float:
    """Seconds left of the spec's budget (all of it outside generate(), which sets the deadline)."""
    return options.timeout_s if options.deadline is None else options.deadline - time.monotonic()


def _budget_spent(outcomes: list[AttemptOutcome], options: GenerateOptions) -> list[AttemptOutcome]:
    """The outcomes, the last saying why no further attempt was started (its feedback becomes the run's error)."""
    note = f"; the spec's budget of {options.timeout_s:g}s (--timeout) is spent: no further attempt started"
    return outcomes[:-1] + [replace(outcomes[-1], feedback=outcomes[-1].feedback + note)]


def _verify(spec: Spec, candidate: Path, options: GenerateOptions, *, backward: bool = False) -> tuple[Verdict, str]:
    left = _budget_left(options)
    if left <= 0:
        return Verdict.timeout, f"not started: the spec's budget of {options.timeout_s:g}s (--timeout) is spent"
    serving = asdict(spec.layout) if spec.layout is not None else None
    res = verify(spec.path, candidate, VerifyOptions(distributions=options.verify_distributions,
                                                     max_cases=options.verify_max_cases, determinism=True, timeout_s=left,
                                                     backward=backward, serving=serving))
    return res.verdict, _verify_detail(res)


def _verify_detail(res) -> str:
    return (f"{res.message} (seed {res.seed}, {res.calls} calls, {len(res.cases)} shapes, "
            f"max abs err {res.max_abs_err:.3g})")

