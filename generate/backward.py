"""The backward stage of `kb generate`: dq, dk, dv (and learnable tables' gradients) for a verified forward.

After the forward kernel passed, the KB's backward references (expert backward kernels lifted into
the IR, and earlier generated backwards) are ranked for the spec; each is tried in turn:
transfer the forward's variant slots into it (generate.transfer_bwd), check the interpreted
gradients against autograd (generate.check_backward), lower forward + backward + autograd glue into
one Triton module (kb.lower.triton_bwd.lower_autograd), write the candidate whose `ModelNew` calls
the differentiable `kb_attention`, and verify it with gradients (verify, `backward=True`). The first
that passes replaces the forward-only candidate; if none does, the forward-only candidate stays and
the report says why there is no backward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from generate.attempts import AttemptOutcome, Failure
from generate.candidate import CandidateFiles, write_candidate
from generate.outputs import OutputError
from generate.check_backward import check_backward_program
from generate.spec import Spec
from generate.stages import Stage
from generate.transfer_bwd import backward_target, transfer_backward
from generate.designs import STRUCTURE_MARGIN, backward_structure, structure_scores, sweeps_from_kb
from kb.errors import KBError
from kb.features import Features
from kb.ir.expr import free_vars, var
from kb.ir.nodes import AuxGrad, Probs, Program, Role, Store, walk_stmts
from kb.ir.text import parse_program, print_program
from kb.ir.validate import validate
from kb.lower.cuda_dispatch import CudaDispatch
from kb.lower.triton_bwd import lower_autograd
from kb.lower.triton_options import LowerOptions
from kb.store.kb import KnowledgeBase
from kb.store.models import Kernel
from retrieve.hybrid import Filters, describe_target, query
from verify.result import Verdict

__all__ = ["BackwardBuilt", "build_backward", "lowering", "run_to_run", "block_parallel", "measured_structures",
           "per_kv_head", "learnable_aux", "nondeterminism", "BACKWARD_STRATEGY"]

BACKWARD_STRATEGY = "backward"  # the strategy name of backward attempts (their rows and the report)
_POOL = 12  # backward references ranked by retrieval before the structural refinement picks the ones tried


@dataclass(frozen=True)
class BackwardBuilt:
    """A backward that passed every stage: its program, reference and the candidate files written for it."""

    program: Program
    reference_id: str
    module_src: str  # the whole Triton module: forward, backward, autograd glue
    files: CandidateFiles
    verdict: Verdict  # passed, or not_run (--no-verify)
    detail: str
    cuda_src: str | None = None  # the `.cu` of the module's CUDA dispatch, with the Hopper backward where it applies
    cuda_runs: str = ""  # which backward runs on the GPU and why (the report's cuda.backward_runs)
    hopper_backward: bool = False  # the dispatch lists the `.cu`'s Hopper backward for some GPU
    timed_designs: bool = True  # the module times its listed designs at run time (LowerOptions.time_designs)


def learnable_aux(spec: Spec) -> tuple[str, ...]:
    """Aux tensors the spec holds as nn.Parameters (their gradients are part of the backward)."""
    return tuple(e.aux for e in spec.state if e.parameter and e.aux)


def build_backward(kb: KnowledgeBase, spec: Spec, forward: Program, *, memory: bool, references: int,
                   verify_fn, designs, stage: Path, stem: str, first_n: int,
                   deterministic: bool = False,
                   cuda: Callable[[Program], tuple[CudaDispatch | None, str]] | None = None,
                   ) -> tuple[BackwardBuilt | None, list[AttemptOutcome]]:
    """Try the ranked backward references in order; (the first that passes, every attempt).

    `designs`: (the forward's design table, the backward's). Retrieval's order is refined by two structural
    facts of the programs: for a GQA/MQA spec, references whose dK/dV kernel runs per KV head (reducing over
    its query heads) come first, since one per query head cannot write a shared KV head's gradient; then
    those whose tile kernels run in parallel over sequence blocks, since a program per (batch, head) that
    walks every KV block itself (FA2's non-sequence-parallel mode) leaves most of a large GPU idle at
    training batch sizes; then, with `memory`, the structure (dq by atomics, or in a pass of its own) that measured
    faster for kernels like this one by at least STRUCTURE_MARGIN (`measured_structures`). The refinement reorders
    retrieval's top `_POOL`; two more references than the forward's are tried: an IR check costs seconds.
    `designs`: the forward's design table and a function giving the backward's for a dq structure (each structure's
    designs ranked by its own sweeps). `deterministic`: only backwards whose gradients are bitwise reproducible (no
    atomics, `nondeterminism`) are tried; the others are recorded as refused. `cuda`: the CUDA dispatch of the combined
    module for a backward program (the forward's, with the Hopper backward where it applies) and why."""
    features = replace(spec.features, backward=True)
    found = query(kb, describe_target(features, *spec.variant_strings()), features, k=_POOL,
                  filters=Filters(memory=memory, backward=True))
    if not found.kernels:
        raise KBError("the KB holds no backward reference program; run `kb ingest --all` first")
    target = backward_target(forward, learnable_aux(spec), (spec.shapes.M, spec.shapes.N))
    programs = {r.id: parse_program(kb.get_row(Kernel, r.id).ir_text) for r in found.kernels}
    gqa = spec.shapes.Hq != spec.shapes.Hkv
    preferred = _preferred(measured_structures(kb, features)) if memory else None
    ranked = sorted(found.kernels, key=lambda r: (deterministic and nondeterminism(programs[r.id]) is not None,
                                                  gqa and not per_kv_head(programs[r.id]),
                                                  not block_parallel(programs[r.id]),
                                                  preferred is not None and backward_structure(programs[r.id]) != preferred))
    ranked = ranked[:references + 2]  # stable: retrieval's order where nothing above tells two apart
    outcomes: list[AttemptOutcome] = []
    for ref in ranked:
        t0 = time.perf_counter()

        def outcome(stage_: Stage, verdict: Verdict, detail: str, text: str = "") -> AttemptOutcome:
            return AttemptOutcome(first_n + len(outcomes), ref.id, BACKWARD_STRATEGY, stage_, verdict, detail,
                                  time.perf_counter() - t0, text)

        try:
            program = transfer_backward(programs[ref.id], target, name=f"{stem}_bwd")
            validate(program)
        except KBError as err:
            outcomes.append(outcome(Stage.TRANSFER, Verdict.compile_error, str(err)))
            continue
        text = print_program(program)
        why = nondeterminism(program) if deterministic else None
        if why:
            outcomes.append(outcome(Stage.TRANSFER, Verdict.compile_error, f"not deterministic (--deterministic): {why}",
                                    text))
            continue
        failure = check_backward_program(program, forward, spec, target.learnable)
        if failure:
            outcomes.append(outcome(Stage.IR_CHECK, Verdict.numeric_mismatch, failure, text))
            continue
        built = _realise(spec, forward, program, ref.id, verify_fn, designs, stage / "backward", stem, cuda,
                         deterministic)
        if isinstance(built, Failure):
            outcomes.append(outcome(built.stage, built.verdict, built.detail, text))
            continue
        outcomes.append(outcome(Stage.VERIFY if built.verdict is Verdict.passed else Stage.LOWER, Verdict.passed,
                                built.detail, text))
        return built, outcomes
    return None, outcomes


def block_parallel(p: Program) -> bool:
    """Every kernel that recomputes P has a grid axis over sequence blocks (an extent in BLOCK_M or BLOCK_N)."""
    tiled = [k for k in p.kernels if any(isinstance(s, Probs) for s in walk_stmts(k.body))]
    return bool(tiled) and all(any(free_vars(ax.extent) & {"BLOCK_M", "BLOCK_N"} for ax in k.grid) for k in tiled)


def nondeterminism(p: Program) -> str | None:
    """Why backward program `p`'s gradients may differ run to run (None: bitwise reproducible). An accumulating store
    (`store dq_acc += ...`, FA2's dq) and an `aux_grad` (a learnable table's gradient) add with atomics from programs
    running in parallel, whose order the GPU does not fix; every other write is one program's registers."""
    stmts = [s for k in p.kernels for s in walk_stmts(k.body)]
    summed = sorted({s.tensor for s in stmts if isinstance(s, Store) and s.accumulate})
    tables = sorted({s.grad for s in stmts if isinstance(s, AuxGrad)})
    why = [f"{', '.join(summed)} accumulated with atomics"] if summed else []
    why += [f"table gradient {', '.join(tables)} accumulated with atomics"] if tables else []
    return "; ".join(why) or None


def run_to_run(built: BackwardBuilt) -> str | None:
    """Why the gradients of the module `built` wrote may differ between two runs on the same inputs (None: bitwise
    reproducible): the backward program's atomics (`nondeterminism`), the `.cu`'s Hopper backward where the module
    runs it (dQ's partials added in the order they arrive), and a design chosen by a timing at a process's first
    call (designs tile the sums differently; `kb generate --deterministic` fixes the design)."""
    atomics = nondeterminism(built.program)
    why = [atomics] if atomics else []
    if built.hopper_backward:
        why.append("the `.cu`'s Hopper backward, where the module runs it, adds dQ's partials in the order they arrive")
    if built.timed_designs:
        why.append("the module runs the listed design a timing at its first call picked, which two runs may pick "
                   "differently (--deterministic fixes the design)")
    return "; ".join(why) or None


def measured_structures(kb: KnowledgeBase, target: Features) -> dict[str, float]:
    """{structure: its speed relative to the fastest} from the KB's backward sweeps where one spec was timed with
    both structures (`generate.designs.structure_scores`); empty when none was."""
    return structure_scores([s for s in sweeps_from_kb(kb) if s.features.backward], target)


def _preferred(measured: dict[str, float]) -> str | None:
    """The structure that measured clearly faster (by STRUCTURE_MARGIN), or None (retrieval's order stands)."""
    if len(measured) < 2:
        return None
    (best, first), (_, second) = sorted(measured.items(), key=lambda kv: -kv[1])[:2]
    return best if first - second >= STRUCTURE_MARGIN else None


def per_kv_head(p: Program) -> bool:
    """The kernel that writes dk runs over KV heads (a grid axis of extent Hkv): GQA/MQA-capable."""
    writers = [k for k in p.kernels if any(isinstance(s, Store) and s.tensor == "dk" for s in walk_stmts(k.body))]
    return bool(writers) and all(any(ax.extent == var("Hkv") for ax in k.grid) for k in writers)


def lowering(deterministic: bool) -> LowerOptions:
    """The lowering's options for a generated module: with --deterministic, no design chosen by a timing at run
    time (the module runs the first listed design that fits, so the same design, and the same bits, every run)."""
    return LowerOptions(time_designs=not deterministic)


def _realise(spec: Spec, forward: Program, program: Program, ref_id: str, verify_fn, designs,
             stage: Path, stem: str, cuda: Callable[[Program], tuple[CudaDispatch | None, str]] | None,
             deterministic: bool) -> BackwardBuilt | Failure:
    try:
        dispatch, runs = cuda(program) if cuda is not None else (None, "")
        src = lower_autograd(forward, program, lowering(deterministic), fwd_designs=designs[0],
                             bwd_designs=designs[1](backward_structure(program)), cuda=dispatch)
        aux = [p.name for p in forward.params if p.role is Role.AUX]
        files = write_candidate(spec, src, aux, stage, stem)
    except OutputError:
        raise  # the run fails here: no attempt can write its files
    except KBError as err:
        return Failure(Stage.LOWER, Verdict.compile_error, str(err))
    verdict, detail = verify_fn(files.candidate)
    if verdict not in (Verdict.passed, Verdict.not_run):
        return Failure(Stage.VERIFY, verdict, detail)
    return BackwardBuilt(program, ref_id, src, files, verdict, detail, dispatch.source if dispatch else None, runs,
                         hopper_backward=bool(dispatch and any(dispatch.backward.values())),
                         timed_designs=lowering(deterministic).time_designs)
