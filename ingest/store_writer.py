"""Write lift reports into the KB: one transaction per lifted file (all of its rows or none).

Lifted programs become `Kernel` rows (IR text, derived features, provenance, verified flag)
with their tunables; snippets and tunables without a program are written beside them.
Ids are content hashes, so re-ingesting the same release is a no-op; a new release adds rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from ingest.model import FetchedSource, SourceKind, LiftedSnippet, LiftedTunable, LiftReport, Provenance
from kb.features import Features
from kb.ir.text import print_program
from kb.store.ids import hashed_id
from kb.store.kb import KnowledgeBase
from kb.store.models import Kernel, Snippet, Source, Tunable
from kb.store.records import assign_id

__all__ = ["source_row", "report_rows", "write_report", "FileCoverage"]


@dataclass(frozen=True)
class FileCoverage:
    file: str
    programs: int
    verified: int
    snippets: int
    tunables: int
    skipped: tuple[tuple[str, str], ...]
    new_rows: int  # rows that were not in the KB before (0 on a re-ingest)
    backward: tuple[tuple[str, str], ...] = ()  # backward kernels / regions and what became of them


def source_id(src: FetchedSource) -> str:
    """A release is one row per version; a local path is one row per path and content read."""
    if src.kind is SourceKind.LOCAL:
        return hashed_id("src-local-", src.filename, src.sha256)
    return f"src-{src.distribution}=={src.version}:{src.kind.value}"


def source_row(src: FetchedSource) -> Source:
    return Source(id=source_id(src), distribution=src.distribution, version=src.version, kind=src.kind.value,
                  filename=src.filename, sha256=src.sha256)


def _snippet(s: LiftedSnippet, sid: str, kernel_id: str | None = None) -> Snippet:
    p = s.provenance
    # Features field names (LiftedSnippet checks them), each with a value of its field's type
    features = cast("dict[str, Any]", s.features)
    return Snippet(kind=s.kind, title=s.title, ir_text=s.ir_text, text=s.text,
                   features_json=Features(**features).to_json() if features else "{}",
                   source_id=sid, kernel_id=kernel_id, file=p.file, line_start=p.line_start, line_end=p.line_end,
                   lifter_version=f"{p.lifter}/{p.lifter_version}")


def _tunable(t: LiftedTunable, sid: str) -> Tunable:
    p: Provenance = t.provenance
    return Tunable(source_id=sid, family=t.family, arch=t.arch, head_dim=t.head_dim, dtype=t.dtype,
                   params_json=json.dumps(t.params, sort_keys=True, default=str), condition=t.condition,
                   file=p.file, line_start=p.line_start, line_end=p.line_end)


def _kernel(lp, sid: str) -> Kernel:
    p = lp.provenance
    return Kernel(name=lp.name, family=lp.family, origin="ingest", ir_text=print_program(lp.program),
                  features_json=lp.features.to_json(), arch=lp.features.arch, dtype=lp.features.dtype,
                  head_dim=lp.features.head_dim or None, source_id=sid, file=p.file, line_start=p.line_start,
                  line_end=p.line_end, lifter_version=f"{p.lifter}/{p.lifter_version}", verified=lp.verified,
                  verify_note=lp.verify_note)


def report_rows(report: LiftReport, sid: str) -> list:
    """All rows of one file's report, parents first (kernels before the rows that point at them)."""
    rows: list = []
    for lp in getattr(report, "programs", ()) or ():
        k = assign_id(_kernel(lp, sid))
        rows.append(k)
        rows += [assign_id(_tunable(t, sid)) for t in lp.tunables]
    rows += [assign_id(_snippet(s, sid)) for s in report.snippets]
    rows += [assign_id(_tunable(t, sid)) for t in report.tunables]
    return rows


def write_report(kb: KnowledgeBase, report: LiftReport, sid: str) -> FileCoverage:
    rows = _dedupe(report_rows(report, sid))
    known = {r.id for r in rows if kb.find(r.id) is not None}
    if rows:
        kb.write_records(rows)
    programs = list(getattr(report, "programs", ()) or ())
    return FileCoverage(report.file, len(programs), sum(1 for p in programs if p.verified), len(report.snippets),
                        len(report.tunables) + sum(len(p.tunables) for p in programs), tuple(report.skipped),
                        len([r for r in rows if r.id not in known]), tuple(getattr(report, "backward", ()) or ()))


def _dedupe(rows: list) -> list:
    seen: set[str] = set()
    out = []
    for r in rows:
        if r.id not in seen:
            seen.add(r.id)
            out.append(r)
    return out
