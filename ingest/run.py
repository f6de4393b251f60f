"""`ingest(kb, sources)`: resolve, fetch, lift and store; returns per-file coverage.

A SOURCE is a corpus manifest name (`flash-attn-2`), `pypi:DIST==VER`, or a local path.
Everything that can fail on bad input (unknown name, download, hash) happens before the
first write; each lifted file is then written in its own transaction.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from ingest.fetch import fetch, fetch_local, fetch_pypi
from ingest.manifest import Manifest, find_manifest, list_manifests
from ingest.model import FetchedSource, LiftReport, SourceKind
from ingest.corpus import lift_source, local_targets
from ingest.store_writer import FileCoverage, source_id, source_row, write_report
from kb.errors import KBError
from kb.store.kb import KnowledgeBase

__all__ = ["IngestSummary", "SourceSummary", "resolve", "ingest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceSummary:
    source: str
    files: tuple[FileCoverage, ...]
    seconds: float


@dataclass
class IngestSummary:
    sources: list[SourceSummary] = field(default_factory=list)
    seconds: float = 0.0

    def totals(self) -> dict[str, int]:
        files = [f for s in self.sources for f in s.files]
        return {
            "files": len(files),
            "programs": sum(f.programs for f in files),
            "backward_kernels": sum(len(f.backward) for f in files),
            "verified": sum(f.verified for f in files),
            "snippets": sum(f.snippets for f in files),
            "tunables": sum(f.tunables for f in files),
            "skipped": sum(len(f.skipped) for f in files),
            "new_rows": sum(f.new_rows for f in files),
        }


def resolve(name: str) -> tuple[str, Manifest | None]:
    """('manifest'|'pypi'|'local', manifest) for a SOURCE; raises KBError with what is known."""
    if name.startswith("pypi:"):
        req = name[5:]
        if "==" not in req:
            raise KBError(f"{name!r}: pin a version, e.g. pypi:flash-attn==2.8.3.post2")
        return "pypi", None
    if Path(name).exists():
        return "local", None
    try:
        return "manifest", find_manifest(name)
    except KBError:
        known = ", ".join(m.name for m in list_manifests())
        raise KBError(f"unknown source {name!r}: not a corpus manifest ({known}), not pypi:DIST==VER, not an existing path") from None


def _fetch(name: str, kind: str, manifest: Manifest | None) -> FetchedSource:
    if kind == "manifest":
        return fetch(manifest)  # type: ignore[arg-type]
    if kind == "pypi":
        dist, ver = name[5:].split("==", 1)
        return fetch_pypi(dist, ver, SourceKind.SDIST)
    src = fetch_local(Path(name))
    _require_kernels(name, src)
    return src


def _require_kernels(name: str, src: FetchedSource) -> None:
    """A local PATH with no file any lifter takes is a user error, raised before anything is written."""
    targets = local_targets(src)
    if not any(t.lifter != "none" for t in targets):
        what = f"read {len(targets)} file(s), none holds a Triton or CuTe kernel or is CUDA/C++" if targets \
            else "no .py or CUDA/C++ file in it"
        raise KBError(f"{name}: no kernels found ({what})")


def _with_fa2_reference(reports: list[LiftReport], src: FetchedSource) -> list[LiftReport]:
    """Add the FA2 CUDA reference Program built from the lifted CUDA snippets and tunables."""
    try:
        from ingest.fa2_reference import build_fa2_references  # noqa: PLC0415  it imports torch: only FA2's CUDA needs it
    except ImportError:
        return reports
    cuda = [r for r in reports if "flash_attn/src" in r.file
            and (any(s.provenance.lifter == "cuda" for s in r.snippets)
                 or any(t.provenance.lifter == "cuda" for t in r.tunables))]
    if not cuda:
        return reports
    try:
        programs = build_fa2_references(cuda, [t for r in cuda for t in r.tunables])
    except KBError as err:
        return reports + [LiftReport("fa2_reference", skipped=(("fa2 reference program", str(err)),))]
    return reports + [LiftReport(f"{programs[0].provenance.file} (FA2 reference programs)", programs=tuple(programs))]


def ingest(kb: KnowledgeBase, names: list[str], *, progress: bool = True) -> IngestSummary:
    t0 = time.perf_counter()
    resolved = [(n, *resolve(n)) for n in names]
    fetched = [(n, _fetch(n, kind, m), m) for n, kind, m in resolved]  # all downloads/hashes before any write
    summary = IngestSummary()
    with Progress(disable=not progress, transient=True, console=Console(stderr=True)) as bar:  # stdout keeps the results
        for name, src, manifest in fetched:
            t1 = time.perf_counter()
            reports = lift_source(src, manifest)
            if src.distribution == "flash-attn":
                reports = _with_fa2_reference(reports, src)
            sid = source_id(src)
            if kb.find(sid) is None:  # the same release or unchanged local content: keep the first row
                kb.write_source(source_row(src))
            task = bar.add_task(f"storing {name}", total=len(reports))
            files = []
            for rep in reports:
                files.append(write_report(kb, rep, sid))
                bar.advance(task)
            summary.sources.append(SourceSummary(name, tuple(files), time.perf_counter() - t1))
    summary.seconds = time.perf_counter() - t0
    return summary
