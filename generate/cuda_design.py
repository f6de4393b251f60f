"""Which CUDA source `kb generate` writes beside the Triton module, and what the report says it is.

The tensor-core lowering (kb.lower.cuda_mma, FA2's structure) takes its traits from the FA2 forward
launch templates lifted into the KB (tunables of family `fa2_cuda`, the sm80 default path of the
spec's head-dim bucket). Where those traits would hold more accumulator registers per thread than
the lowering keeps without spilling (`MAX_ACC_REGS`, from ptxas on sm_80/sm_90a), BLOCK_N halves
down to 64 and then the warps double, keeping FA2's query tile. A program the tensor-core lowering
declines gets the portable SIMT lowering (kb.lower.cuda), and the report says why.

Until the tensor-core kernel is measured within 10% of the Triton module on the target, the report
labels the `.cu` the portable reference (`ROLE_REFERENCE`); the Triton module is what ModelNew runs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from kb.errors import KBError
from kb.ir.design import head_bucket
from kb.ir.nodes import Program
from kb.lower.cuda_mma import FA2_TRAITS, MmaTraits

__all__ = ["CudaChoice", "CudaPlan", "choose_cuda", "cuda_plan", "cuda_role", "fa2_traits", "fit_registers", "MAX_ACC_REGS", "ROLE_REFERENCE"]

log = logging.getLogger(__name__)

MAX_ACC_REGS = 96  # fp32 score + output fragment registers per thread that the variants keep without spills (ptxas, sm_80/sm_90a)
ROLE_REFERENCE = ("portable reference: not measured within 10% of the Triton module on the target GPU; "
                  "ModelNew runs the Triton module")


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
    import json

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
    from kb.lower.cuda import lower_program as lower_portable
    from kb.lower.cuda_mma import lower_program_mma, with_traits
    from kb.lower.cuda_sm90_ir import lower_program_sm90

    declined: dict[str, str] = {}
    if plan.target == "sm90":
        try:
            return CudaChoice(lower_program_sm90(program, plan.head_dim), "sm90_wgmma", "sm_90a", {
                "lowering": "sm90_wgmma", "structure": "FA3/CUTLASS 88: TMA producer warpgroup, two wgmma consumer "
                "warpgroups (ping-pong, intra-warpgroup overlap), hooks from the IR", "arch": "sm_90a",
                "head_dim": plan.head_dim, "role": ROLE_REFERENCE})
        except KBError as err:
            declined["sm90_wgmma"] = str(err)
    try:
        src = lower_program_mma(with_traits(program, plan.traits))
        return CudaChoice(src, "tensor_cores", "sm_80", {
            "lowering": "tensor_cores", "structure": "FA2: mma.sync m16n8k16, ldmatrix from swizzled shared memory, "
            "cp.async K/V overlap", "traits": str(plan.traits), "traits_from": plan.traits_from, "arch": "sm_80",
            "role": ROLE_REFERENCE, **({"declined": declined} if declined else {})})
    except KBError as err:
        declined["tensor_cores"] = str(err)
    try:
        src = lower_portable(program)
    except KBError as err:
        log.warning("CUDA lowering failed: %s", err)
        return None
    return CudaChoice(src, "portable", "sm_80", {"lowering": "portable", "structure": "SIMT, tiles in shared memory "
                      "(no tensor cores)", "arch": "sm_80", "declined": declined, "role": ROLE_REFERENCE})


def cuda_role(kb, kernel_id: str, arch: str, lowering: str) -> dict:  # noqa: ANN001 - KnowledgeBase
    """The `.cu`'s role from the KB's measurements of this kernel on `arch`: the latest shape where both the emitted
    Triton module and a `.cu` of the same lowering were timed. Within 10% of Triton: an alternative; otherwise (or
    never measured) the portable reference. ModelNew runs the Triton module either way."""
    from kb.store import PerfRecord

    from generate.perf_import import cuda_impl

    rows = [r for r in kb.usable(PerfRecord, kind="measured", kernel_id=kernel_id) if r.arch == arch and r.ms]
    want = json.dumps(cuda_impl(lowering), sort_keys=True)
    cu = sorted((r for r in rows if r.design_json == want), key=lambda r: str(r.measured_at or ""))
    for c in reversed(cu):
        tri = [r for r in rows if r.design_json == "{}" and r.shape_json == c.shape_json and r.gpu == c.gpu
               and r.measured_at == c.measured_at]  # timed in the same run
        if not tri:
            continue
        ratio = tri[-1].ms / c.ms
        where = f"{ratio:.2f}x the Triton module on {c.gpu} at {c.shape_json} ({c.measured_at:%Y-%m-%d})"
        if c.ms <= 1.1 * tri[-1].ms:
            return {"role": f"alternative: measured {where}; ModelNew runs the Triton module", "measured_vs_triton": ratio}
        return {"role": f"portable reference: measured {where}; ModelNew runs the Triton module",
                "measured_vs_triton": ratio}
    return {"role": ROLE_REFERENCE}


def cuda_plan(target: str, head_dim: int, tunables: list) -> CudaPlan:
    traits, origin = fa2_traits(tunables, head_dim)
    return CudaPlan(target, head_dim, traits, origin)
