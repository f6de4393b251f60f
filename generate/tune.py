"""`kb tune`: search designs for generated kernels on a GPU and write what was measured back to the KB.

For each spec (or generated kernel) the candidate that `kb generate` wrote is taken from its output
directory, the designs are enumerated in the order the KB's performance memory ranks them for the
target arch (`generate.designs`; `--no-memory` uses the expert tunables and default grid only), the
GPU half (`bench.gpu.tune`) times them beside FlexAttention and SDPA, and `generate.perf_import`
writes the measured records and a lesson in one transaction.

Without a GPU here, `make_plan` writes the same work as a plan file: run
`python -m bench.gpu.tune PLAN RESULTS` on a GPU machine (it needs torch and triton, not the KB),
then `kb perf import RESULTS` here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from generate.designs import backward_structure, rank_designs, sweeps_from_kb, tunable_rows
from generate.outputs import output_stem
from generate.spec import import_spec_file
from generate.stages import ReportStatus
from generate.tune_schema import PLAN_SCHEMA, bench_shapes
from kb.errors import KBError
from kb.features import Features
from kb.ir.design import arch_of_capability, head_bucket
from kb.ir.text import parse_program
from kb.store.models import Kernel

__all__ = ["make_plan", "plan_entries", "DEFAULT_MAX_DESIGNS"]

DEFAULT_MAX_DESIGNS = 10


def _resolve(kb, target: str, from_dir: Path, backward: bool = False) -> tuple[Path, Path, Kernel]:
    """(spec path, candidate path, kernel row) for a spec file or a generated kernel id; `backward`: the kernel row
    is the candidate's backward kernel (the one its designs belong to)."""
    if target.startswith("k-"):
        kernel = kb.get(target)
        if not isinstance(kernel, Kernel) or not kernel.file:
            raise KBError(f"{target} is not a generated kernel with a spec file; tune the spec instead")
        spec_path = Path(kernel.file)
    else:
        spec_path = Path(target)
        if not spec_path.is_file():
            raise KBError(f"spec file {spec_path} does not exist")
        kernel = None
    report_path = from_dir / f"{output_stem(spec_path)}.report.json"
    cand = from_dir / f"{output_stem(spec_path)}.py"
    if not report_path.is_file() or not cand.is_file():
        raise KBError(f"no generated candidate for {spec_path} in {from_dir}",
                      hint=f"run `kb generate {spec_path} --out {from_dir}` first, or pass --from DIR")
    report = json.loads(report_path.read_text())
    if report.get("status") not in (ReportStatus.VERIFIED, ReportStatus.UNVERIFIED):
        raise KBError(f"{report_path} says {report.get('status')!r}: nothing to tune")
    if backward:
        back = report.get("backward") or {}
        if back.get("status") not in (ReportStatus.VERIFIED, ReportStatus.UNVERIFIED) or not back.get("kernel_id"):
            raise KBError(f"{cand} has no backward to tune ({back.get('status') or 'none'}: "
                          f"{str(back.get('reason') or '')[:200]})", hint="generate it without --no-backward first")
        return spec_path, cand, kb.get(back["kernel_id"])
    if kernel is None:
        kernel = kb.get(report["kernel_id"])
    return spec_path, cand, kernel


def _kernel_payload(k: Kernel) -> dict:
    keep = ("id", "name", "family", "origin", "ir_text", "features_json", "dtype", "head_dim", "verified",
            "verify_note", "parent_id", "spec_hash", "file")
    return {f: getattr(k, f) for f in keep}


def plan_entries(kb, targets: list[str], from_dir: Path, arch: str, *, max_designs: int = DEFAULT_MAX_DESIGNS,
                 memory: bool = True, backward: bool = False) -> list[dict]:
    """One entry per (spec, bench shape): the designs to time, in the memory-on order, with both orders kept
    (`max_designs=0`: none, only the candidate as emitted and the baselines: `kb bench`). `backward`: the designs of
    the candidate's backward kernel, timed as training steps (`bench.gpu.tune_bwd`); the entry's kernel is that
    backward kernel, so the measured records become the backward's performance memory."""
    sweeps = sweeps_from_kb(kb, arch)
    tunables = tunable_rows(kb)
    entries = []
    for target in targets:
        spec_path, cand, kernel = _resolve(kb, target, from_dir, backward)
        feats = Features.from_json(kernel.features_json)
        shapes = bench_shapes(import_spec_file(spec_path))
        for shape in shapes:
            d = shape.get("D") or feats.head_dim
            f = dataclasses.replace(feats, head_dim=d, arch=arch)
            dv = shape.get("Dv")
            vb = head_bucket(dv) if dv else None
            st = backward_structure(parse_program(kernel.ir_text)) if backward else None
            on = rank_designs(f, arch, head_bucket(d), sweeps, tunables, memory=True, value_bucket=vb,
                              structure=st)[:max_designs]
            off = rank_designs(f, arch, head_bucket(d), sweeps, tunables, memory=False, value_bucket=vb)[:max_designs]
            timed = list(dict.fromkeys((on if memory else off) + (off if memory else on))) if max_designs else []
            name = spec_path.stem + (f"_d{d}" if len(shapes) > 1 else "")
            entries.append({"name": name, "spec": str(spec_path), "candidate": str(cand), "shapes": [shape] if shape else None,
                            "kernel": _kernel_payload(kernel), "backward": backward, "designs": [str(x) for x in timed],
                            "order_memory": [str(x) for x in on], "order_no_memory": [str(x) for x in off]})
    return entries


def make_plan(kb, targets: list[str], from_dir: Path, arch: str, *, max_designs: int = DEFAULT_MAX_DESIGNS,
              memory: bool = True, backward: bool = False) -> dict:
    return {"schema": PLAN_SCHEMA, "arch": arch, "memory": memory, "backward": backward,
            "entries": plan_entries(kb, targets, from_dir, arch, max_designs=max_designs, memory=memory,
                                    backward=backward)}


def require_gpu() -> str:
    """The local GPU's arch, or a KBError saying how to tune without one."""
    if not torch.cuda.is_available():
        raise KBError("kb tune needs a CUDA GPU to time designs, and this machine has none",
                      hint="`kb tune SPEC --plan PLAN.json` writes the work here; run `python -m bench.gpu.tune "
                           "PLAN.json RESULTS.json` on a GPU machine, then `kb perf import RESULTS.json`")
    return arch_of_capability(torch.cuda.get_device_capability())
