"""Which CUDA source `kb generate` writes beside the Triton module, and what the report says it is.

The tensor-core lowering (kb.lower.cuda_mma, FA2's structure) takes its traits from the FA2 forward
launch templates lifted into the KB (tunables of family `fa2_cuda`, the sm80 default path of the
spec's head-dim bucket). Where those traits would hold more accumulator registers per thread than
the lowering keeps without spilling (`MAX_ACC_REGS`, from ptxas on sm_80/sm_90a), BLOCK_N halves
down to 64 and then the warps double, keeping FA2's query tile. A program the tensor-core lowering
declines gets the portable SIMT lowering (kb.lower.cuda), and the report says why.

Where the `.cu` runs: `forward_dispatch` decides from measured records (`cuda_pairs`: the `.cu` and the Triton module
of one kernel timed in the same run), the kernel's own first, else those of kernels like it; the module then runs the
`.cu` on that arch and head dim (kb.lower.cuda_dispatch), and the report's `cuda.runs` says which runs and why.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace

from generate.designs import perf_similarity
from generate.perf_import import cuda_impl
from kb.errors import KBError
from kb.features import Features
from kb.ir.design import head_bucket
from kb.ir.nodes import Program
from kb.ir.text import content_hash
from kb.lower.cuda import lower_program as lower_portable
from kb.lower.cuda_dispatch import CudaDispatch
from kb.lower.cuda_mma import FA2_TRAITS, MmaTraits, lower_program_mma, with_traits
from kb.lower.cuda_sm90_ir import backward_refusal, hopper_program, lower_program_sm90
from kb.store import Kernel, PerfRecord

__all__ = ["CUDA_LOWERINGS", "CudaChoice", "CudaPair", "CudaPlan", "choose_cuda", "cuda_pairs", "forward_dispatch",
           "with_backward", "cuda_plan", "fa2_traits", "fit_registers", "MAX_ACC_REGS"]

log = logging.getLogger(__name__)

MAX_ACC_REGS = 96  # fp32 score + output fragment registers per thread that the variants keep without spills (ptxas, sm_80/sm_90a)
DISPATCH_MIN_SIMILARITY = 0.9  # a measured kernel at least this alike (perf_similarity) lets the `.cu` run for another
CUDA_LOWERINGS = ("sm90_wgmma", "tensor_cores", "portable")  # choose_cuda's, in its order of preference


@dataclass(frozen=True)
class CudaPlan:
    """What `choose_cuda` needs to know about a spec: the target arch, the head dim, the FA2 traits and their origin."""

    target: str  # sm90, sm80, ...
    head_dim: int
    traits: MmaTraits
    traits_from: str


@dataclass(frozen=True)
class CudaChoice:
    source: str
    lowering: str  # sm90_wgmma | tensor_cores | portable
    arch: str  # what nvcc builds it for (sm_90a for the Hopper template)
    report: dict


def _acc_regs(t: MmaTraits, head_pad: int) -> int:
    return t.block_m // t.num_warps // 16 * (t.block_n // 2 + head_pad // 2)


def fit_registers(t: MmaTraits, head_pad: int) -> MmaTraits:
    """`t` with BLOCK_N halved (down to 64), then the warps doubled, until the fragments fit MAX_ACC_REGS."""
    while _acc_regs(t, head_pad) > MAX_ACC_REGS:
        if t.block_n > 64:
            t = MmaTraits(t.block_m, t.block_n // 2, t.num_warps)
        elif t.block_m // (t.num_warps * 2) >= 16:
            t = MmaTraits(t.block_m, t.block_n, t.num_warps * 2)
        else:
            break
    return t


def fa2_traits(tunables: list, head_dim: int) -> tuple[MmaTraits, str]:
    """FA2's sm80 forward traits for the head-dim bucket from the KB's lifted tunables (rows with
    `family`, `arch`, `head_dim`, `params_json`, `condition`, `id`), register-fitted; (traits, where from)."""
    bucket = head_bucket(head_dim)
    for row in tunables:
        terms = [c.strip() for c in (row.condition or "").split("&&") if c.strip()]
        if row.family != "fa2_cuda" or row.arch != "sm80" or row.head_dim != bucket or any(not c.startswith("!") for c in terms):
            continue
        prm = json.loads(row.params_json)
        if not all(type(prm.get(k)) is int for k in ("block_m", "block_n", "num_warps")):
            continue  # a launch template that names its tiles by constant, not number
        lifted = MmaTraits(prm["block_m"], prm["block_n"], prm["num_warps"])
        fitted = fit_registers(lifted, bucket)
        note = f"FA2 launch template ({row.file}:{row.line_start}) {lifted}"
        return fitted, note + ("" if fitted == lifted else f", register-fitted to {fitted}")
    fallback = fit_registers(FA2_TRAITS.get(bucket, MmaTraits(64, 64, 4)), bucket)
    return fallback, f"built-in FA2 traits for head dim {bucket} (no lifted fa2_cuda tunable in this KB)"


def choose_cuda(program: Program, plan: CudaPlan) -> CudaChoice | None:
    """The CUDA source for `program`: on an sm90 target the Hopper template (wgmma, TMA, warp specialised) where
    it accepts the program, else FA2's tensor-core structure, else the portable lowering; None when none lowers
    (the report then has no `.cu`). Each refusal's reason goes into the report."""
    declined: dict[str, str] = {}
    if plan.target == "sm90":
        try:
            retyped = hopper_program(program) is not program
            return CudaChoice(lower_program_sm90(program, plan.head_dim), "sm90_wgmma", "sm_90a", {
                "lowering": "sm90_wgmma", "structure": "FA3/CUTLASS 88: TMA producer warpgroup, two wgmma consumer "
                "warpgroups (ping-pong, intra-warpgroup overlap), hooks from the IR", "arch": "sm_90a",
                "head_dim": plan.head_dim, **({"dtype": "bf16 (the spec was traced in fp32: fp32 inputs run the "
                                                        "Triton kernels)"} if retyped else {})})
        except KBError as err:
            declined["sm90_wgmma"] = str(err)
    try:
        src = lower_program_mma(with_traits(program, plan.traits))
        return CudaChoice(src, "tensor_cores", "sm_80", {
            "lowering": "tensor_cores", "structure": "FA2: mma.sync m16n8k16, ldmatrix from swizzled shared memory, "
            "cp.async K/V overlap", "traits": str(plan.traits), "traits_from": plan.traits_from, "arch": "sm_80",
            **({"declined": declined} if declined else {})})
    except KBError as err:
        declined["tensor_cores"] = str(err)
    try:
        src = lower_portable(program)
    except KBError as err:
        log.warning("CUDA lowering failed: %s", err)
        return None
    return CudaChoice(src, "portable", "sm_80", {"lowering": "portable", "structure": "SIMT, tiles in shared memory "
                      "(no tensor cores)", "arch": "sm_80", "declined": declined})


@dataclass(frozen=True)
class CudaPair:
    """One shape at which a `.cu` and the Triton module of the same kernel were timed in the same run."""

    kernel_id: str
    features: Features
    gpu: str
    shape: dict
    measured_at: str
    triton_ms: float
    cuda_ms: float

    @property
    def speedup(self) -> float:
        """> 1: the `.cu` ran faster than the Triton module."""
        return self.triton_ms / self.cuda_ms

    def describe(self) -> str:
        s = self.shape
        where = f"B{s.get('B')} Hq{s.get('Hq')}/{s.get('Hkv')} {s.get('M')}x{s.get('N')} D{s.get('D')}"
        return f"{self.speedup:.2f}x the Triton module for {self.kernel_id} on {self.gpu} at {where} ({self.measured_at[:10]})"


def cuda_pairs(kb, arch: str, lowering: str) -> list[CudaPair]:
    """Every measured `.cu` of `lowering` on `arch` beside the Triton module of the same kernel, shape, GPU and run."""
    rows = [r for r in kb.usable(PerfRecord, kind="measured") if r.arch == arch and r.ms]
    want = json.dumps(cuda_impl(lowering), sort_keys=True)
    triton = {(r.kernel_id, r.shape_json, r.gpu, r.measured_at): r.ms for r in rows if r.design_json == "{}"}
    pairs = []
    for r in rows:
        tri = triton.get((r.kernel_id, r.shape_json, r.gpu, r.measured_at))
        kernel = kb.find(r.kernel_id) if r.design_json == want and tri else None
        if tri and isinstance(kernel, Kernel) and kb.skip_unusable([kernel]):
            pairs.append(CudaPair(r.kernel_id, Features.from_json(kernel.features_json), r.gpu, json.loads(r.shape_json),
                                  f"{r.measured_at:%Y-%m-%d}", tri, r.ms))
    return sorted(pairs, key=lambda p: (p.measured_at, p.kernel_id))


def forward_dispatch(pairs: list[CudaPair], target: Features, bucket: int, kernel_id: str | None = None) -> tuple[bool, str]:
    """Whether the `.cu` should run for `target` at head-dim `bucket`, and the measurement that says so.

    The kernel's own pairs decide when there are any; otherwise the pairs of other kernels, weighted by how alike they
    are in what decides speed (`perf_similarity`, as design ranking weighs sweeps), provided one of them is alike
    (`DISPATCH_MIN_SIMILARITY`: the `.cu`'s speed against Triton swings from 0.27x to 1.26x with the mask and score_mod,
    run 16, so a plain kernel's measurement says nothing about a document mask's or a decode's). The `.cu` runs when
    the weighted geometric mean of (Triton ms / `.cu` ms) is above 1; without such a measurement at this bucket, the
    Triton module runs."""
    at = [p for p in pairs if p.shape.get("D") and head_bucket(int(p.shape["D"])) == bucket]
    own = [p for p in at if p.kernel_id == kernel_id]
    used = own or at
    if not used:
        return False, "the Triton module runs: no `.cu` of this lowering was measured beside its Triton module here"
    nearest = max(perf_similarity(target, p.features) for p in used)
    if not own and nearest < DISPATCH_MIN_SIMILARITY - 1e-9:  # similarities are sums of float weights
        return False, (f"the Triton module runs: no kernel alike was measured with its `.cu` here (the nearest of "
                       f"{len(used)} is {nearest:.2f} alike; {DISPATCH_MIN_SIMILARITY} needed)")
    weights = [1.0 if own else math.exp(8.0 * (perf_similarity(target, p.features) - 1.0)) for p in used]
    mean = math.exp(sum(w * math.log(p.speedup) for w, p in zip(weights, used)) / sum(weights))
    best = max(zip(weights, used), key=lambda wp: wp[0])[1]
    basis = "this kernel" if own else f"{len(used)} kernel measurement(s), weighted by similarity; nearest: {best.describe()}"
    verdict = "the `.cu` runs" if mean > 1.0 else "the Triton module runs"
    return mean > 1.0, f"{verdict}: measured {mean:.2f}x the Triton module ({basis})" + (f": {best.describe()}" if own else "")


def with_backward(dispatch: CudaDispatch | None, forward: Program, bwd: Program, target: str, head_dim: int,
                  pairs: list[CudaPair], features: Features) -> tuple[CudaDispatch | None, str]:
    """The forward's dispatch with the Hopper backward (kb.lower.cuda_sm90_bwd) in its `.cu` where `bwd` qualifies
    (`backward_refusal`), listed where measured records say that it runs faster than backward()'s Triton kernels
    (`forward_dispatch` over the backward programs' pairs); and the report's sentence saying which runs and why."""
    if dispatch is None or dispatch.arch != "sm_90a":
        return dispatch, "backward()'s Triton kernels run: the `.cu` is not the Hopper template"
    why_not = backward_refusal(forward, bwd)
    if why_not:
        return dispatch, f"backward()'s Triton kernels run: the Hopper backward does not apply ({why_not})"
    source = lower_program_sm90(forward, head_dim, backward=True)
    bucket = head_bucket(head_dim)
    faster, why = forward_dispatch([p for p in pairs if p.features.backward], features, bucket,
                                   "k-" + content_hash(bwd)[:16])
    listed = {target: {bucket: why}} if faster else {}
    runs = f"{why} (the `.cu`'s Hopper backward against backward()'s Triton kernels, on {target}, head dim {bucket})"
    return replace(dispatch, source=source, has_backward=True, backward=listed), runs


def cuda_plan(target: str, head_dim: int, tunables: list) -> CudaPlan:
    traits, origin = fa2_traits(tunables, head_dim)
    return CudaPlan(target, head_dim, traits, origin)
