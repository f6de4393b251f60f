"""Measurements from a GPU machine into the KB: `kb perf import RESULTS.json` (and `kb tune`'s write-back).

A results document (`bench.gpu.tune`, schema `kernel-kb/tune/v1`; or `bench.gpu.tune_bwd` from a
`kb tune --backward` plan, schema `kernel-kb/tune-backward/v1`, whose kernels are backward programs and whose
records time one training step per backward design) becomes, in ONE transaction:
- the kernel each entry timed (its IR record travels with the results, so a KB that never generated
  it, such as a fresh `make demo` importing the shipped corpus, gets it; an existing kernel is left
  as it is, lineage included);
- one `measured` perf record per design that ran correctly (`arch`, `design_json`), one for the
  candidate as emitted, each with the GPU, driver, versions, shape, dtype, command and date of the run;
- one performance lesson per entry and shape: which design won, by how much over the design listed
  first, and how the winner compares with FlexAttention and SDPA.
Documents that do not say where they were measured (GPU, driver, command, date, arch) or that carry
malformed records are refused whole, with the reason: the file, the entry, and the rule a record breaks
(`kb.store.rules`: a design Triton can run, a shape of positive ints, ...). The shipped corpus loads the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlmodel import SQLModel

from generate.tune_schema import SCHEMA, SCHEMA_BACKWARD, impl_ms
from kb.data_files import corpus_files
from kb.errors import KBError
from kb.features import Features
from kb.ir.design import parse_design
from kb.ir.text import parse_program
from kb.store.models import Kernel, Lesson, Origin, PerfRecord
from kb.store.records import assign_id
from kb.store.rules import violations

__all__ = ["ImportSummary", "import_results", "load_results", "impl_ms", "import_corpus", "corpus_results", "cuda_impl"]

_ENV_NEEDS = ("gpu", "driver", "arch", "command", "date", "torch_version", "triton_version")


@dataclass(frozen=True)
class ImportSummary:
    kernels_added: int
    perf_records: int
    lessons: int
    entries: int


def load_results(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as err:
        raise KBError(f"cannot read {path}: {err.strerror or err}") from err
    except ValueError as err:
        raise KBError(f"{path} is not JSON ({err})") from err
    _check_doc(doc, str(path))
    return doc


def _check_doc(doc: Any, where: str) -> None:
    if not isinstance(doc, dict) or doc.get("schema") not in (SCHEMA, SCHEMA_BACKWARD):
        raise KBError(f"{where} is not a kernel-kb tune results file (schema {SCHEMA!r} or {SCHEMA_BACKWARD!r})")
    env = doc.get("env")
    env = env if isinstance(env, dict) else {}
    missing = [k for k in _ENV_NEEDS if not env.get(k)]
    if missing:
        raise KBError(f"{where}: unattributed measurements: env lacks {', '.join(missing)}",
                      hint="only results written by `python -m bench.gpu.tune` / `kb tune` on a GPU are imported")
    try:
        datetime.fromisoformat(env["date"])
    except ValueError as err:
        raise KBError(f"{where}: env.date {env['date']!r} is not an ISO date") from err


def import_results(kb, doc: dict, where: str = "results") -> ImportSummary:
    """Write the kernels, measured records and lessons of `doc` in one transaction; a document with any malformed
    part, or a record that breaks a rule, is refused whole (nothing written), naming the entry and why."""
    _check_doc(doc, where)
    entries = doc.get("entries", [])
    if not isinstance(entries, list):
        raise KBError(f"{where}: 'entries' is not a list; nothing was imported")
    staged: list[tuple[str, SQLModel]] = []  # (which entry, record)
    for n, entry in enumerate(entries, 1):
        label = f"{where}: entry {n} ({entry.get('name', '?') if isinstance(entry, dict) else '?'})"
        try:
            staged += [(label, r) for r in _entry_records(kb, entry, doc["env"], label, [r for _, r in staged],
                                                          backward=doc["schema"] == SCHEMA_BACKWARD)]
        except (KeyError, TypeError, ValueError, AttributeError) as err:  # a field missing or of the wrong type
            raise KBError(f"{label}: malformed ({type(err).__name__}: {err}); nothing was imported") from None
    for label, r in staged:
        broken = violations(r)
        if broken:
            raise KBError(f"{label}: a {type(r).__name__} that breaks the KB's rules: {'; '.join(broken)}; "
                          "nothing was imported")
    kb.write_records([r for _, r in staged])
    kernels, perf_records, lessons = (sum(isinstance(r, t) for _, r in staged) for t in (Kernel, PerfRecord, Lesson))
    return ImportSummary(kernels, perf_records, lessons, len(entries))


def _entry_records(kb, entry: dict, env: dict, label: str, staged: list, backward: bool) -> list:
    """The records one results entry adds: its kernel (unless the KB or `staged` has it), measured records, lessons.
    `backward`: a training-step sweep (`kb tune --backward`), whose kernel must be a backward program."""
    if entry.get("error") or not entry.get("shapes"):
        return []
    out: list = []
    kernel = _kernel(entry.get("kernel"), label)
    if Features.from_json(kernel.features_json).backward != backward:
        raise KBError(f"{label}: {'a training-step sweep' if backward else 'a forward sweep'} whose kernel "
                      f"{kernel.id} is {'not ' if backward else ''}a backward program; nothing was imported")
    if kb.find(kernel.id) is None and all(getattr(r, "id", None) != kernel.id for r in staged):
        if kernel.parent_id and kb.find(kernel.parent_id) is None:
            kernel.parent_id = None  # its reference is not in this KB; the kernel stands alone
        out.append(kernel)
    feats = Features.from_json(kernel.features_json)
    for shape in entry["shapes"]:
        if "records" not in shape:
            continue
        out += _perf_rows(kernel.id, env, shape, label, backward)
        lesson = _lesson(feats, env, shape, backward)
        if lesson is not None:
            out.append(lesson)
    return out


def _kernel(payload: Any, label: str) -> Kernel:
    if not isinstance(payload, dict) or not payload.get("ir_text"):
        raise KBError(f"{label}: no kernel record (ir_text) to attach the measurements to")
    try:
        program = parse_program(payload["ir_text"])
    except KBError as err:
        raise KBError(f"{label}: the kernel's IR does not parse: {err}") from err
    k = Kernel(name=payload.get("name") or program.name, family=payload.get("family") or "generated",
               origin=payload.get("origin") or Origin.GENERATED.value, ir_text=payload["ir_text"],
               features_json=payload.get("features_json") or "{}", dtype=payload.get("dtype") or "",
               head_dim=payload.get("head_dim"), verified=bool(payload.get("verified")),
               verify_note=payload.get("verify_note") or "", parent_id=payload.get("parent_id"),
               spec_hash=payload.get("spec_hash") or "", file=payload.get("file") or "")
    assign_id(k)
    if payload.get("id") and payload["id"] != k.id:
        raise KBError(f"{label}: kernel id {payload['id']} is not the content hash of its IR ({k.id})")
    return k


def _perf_rows(kernel_id: str, env: dict, shape: dict, label: str, backward: bool) -> list[PerfRecord]:
    dims = {k: v for k, v in shape.get("shape", {}).items() if k in ("B", "Hq", "Hkv", "M", "N", "D", "Dv", "attended_pairs")}
    flex = impl_ms(shape, "flex")
    sdpa = impl_ms(shape, "sdpa")
    base = ", ".join(f"{name} {ms:.4g} ms" for name, ms in (("flex", flex), ("sdpa", sdpa)) if ms)
    rows = []
    for r in shape["records"]:
        if r.get("status") != "ok" or not (r["impl"].startswith("design ") or r["impl"] in ("emitted", *_CUDA_IMPLS)):
            continue
        if r["impl"] in _CUDA_IMPLS:  # the .cu beside the module, as written (not a design of the Triton module)
            design_json = json.dumps(cuda_impl(r.get("lowering")), sort_keys=True)
            notes = f"the emitted .cu ({r.get('lowering') or 'lowering not recorded'}) through {_CUDA_IMPLS[r['impl']]}"
        elif r["impl"] == "emitted":
            design_json = "{}"
            notes = (f"as emitted by kb generate (ModelNew training step, backward design {shape.get('emitted_bwd_design')})"
                     if backward else f"as emitted by kb generate (ModelNew, design {shape.get('emitted_design')})")
        else:
            try:
                design_json = json.dumps(parse_design(r["design"]).to_dict(), sort_keys=True)
            except (KBError, KeyError) as err:
                raise KBError(f"{label}: bad design in record {r.get('impl')!r}: {err}") from err
            notes = "design sweep" + (f" of the backward: one training step, forward at {shape.get('emitted_design')}"
                                      if backward else "")
        ms, tflops = r.get("ms"), r.get("tflops")
        if not isinstance(ms, (int, float)) or not ms > 0:
            raise KBError(f"{label}: record {r['impl']!r} has no positive ms ({ms!r})")
        rows.append(PerfRecord(kernel_id=kernel_id, kind="measured", gpu=env["gpu"], driver=env["driver"],
                               torch_version=env["torch_version"], triton_version=env["triton_version"],
                               shape_json=json.dumps(dims, sort_keys=True), dtype=shape.get("dtype", ""), ms=float(ms),
                               tflops=float(tflops) if tflops else None, command=env["command"],
                               measured_at=datetime.fromisoformat(env["date"]), arch=env["arch"],
                               design_json=design_json, notes=f"{notes}; {base}" if base else notes))
    return rows


# results records of the `.cu` beside a module: its forward (`kb tune`), and the training step with its Hopper backward
# (`kb tune --backward`, bench.gpu.tune_bwd); a backward sweep's kernel is the backward program, so its pairs are
# told apart from the forward's by the kernel's features (generate.cuda_design.with_backward)
_CUDA_IMPLS = {"emitted-cuda": "kb_launch", "emitted-cuda-bwd": "kb_launch_bwd (one training step, forward as emitted)"}


def cuda_impl(lowering: str | None) -> dict:
    """The `design_json` of a measured `.cu`: what it is, never a Triton design."""
    return {"impl": "cuda", "lowering": lowering or ""}


def _lesson(feats: Features, env: dict, shape: dict, backward: bool) -> Lesson | None:
    designs = [r for r in shape["records"] if r["impl"].startswith("design ")]
    ok = [r for r in designs if r.get("status") == "ok"]
    if not ok:
        return None
    best = min(ok, key=lambda r: r["ms"])
    first = designs[0]
    dims = shape.get("shape", {})
    measured = replace(feats, head_dim=dims["D"]) if isinstance(dims.get("D"), int) else feats  # the head dim timed
    where = (f"On {env['gpu']} ({env['arch']}), for {measured.describe()} at B{dims.get('B')} H{dims.get('Hq')}/{dims.get('Hkv')} "
             f"M{dims.get('M')} N{dims.get('N')} D{dims.get('D')}")
    if first.get("status") == "ok" and first is not best:
        vs = f"{first['ms'] / best['ms'] - 1:.0%} faster than {first['design']} listed first ({first['ms']:.3f} ms)"
    elif first is best:
        vs = "the design listed first was the fastest"
    else:
        vs = f"{first['design']} listed first did not run ({first.get('status')})"
    flex, sdpa = impl_ms(shape, "flex"), impl_ms(shape, "sdpa")
    ratios = "; ".join(f"{flex_or / best['ms']:.2f}x {name}" for name, flex_or in (("FlexAttention", flex), ("SDPA", sdpa))
                       if flex_or)
    what = "backward design" if backward else "design"
    step = " per training step (forward + backward)" if backward else ""
    text = (f"{where}: {what} {best['design']} was fastest of {len(ok)} correct designs, {best['ms']:.3f} ms{step} "
            f"({best.get('tflops', 0):.0f} TFLOP/s), {vs}" + (f"; speed vs {ratios}" if ratios else "") + ".")
    return Lesson(kind="perf_design", text=text, features_json=feats.to_json())


def corpus_results() -> list[Path]:
    """The measured results shipped with kernel-kb (`corpus/measured/*.json`), each with its provenance; none is an error."""
    return corpus_files("measured/*.json")


def import_corpus(kb) -> ImportSummary:
    """Import every shipped results file (idempotent: the same measurement is the same row)."""
    totals = [0, 0, 0, 0]
    for path in corpus_results():
        s = import_results(kb, load_results(path), str(path))
        for i, v in enumerate((s.kernels_added, s.perf_records, s.lessons, s.entries)):
            totals[i] += v
    return ImportSummary(*totals)
