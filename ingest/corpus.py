"""Which files of a fetched source go to which lifter, and running the lifters over them.

Manifest paths are globs with `{a,b}` alternation (`ingest.manifest.expand_braces`; `glob` has none).
Local sources (`kb ingest PATH`) pick lifters by file type: C++/CUDA sources -> cuda; Python
files that import `cutlass.cute` -> cute, `triton` -> triton; every other file read is reported
with the reason no lifter took it.
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ingest.fetch import local_files
from ingest.manifest import Manifest, expand_braces
from ingest.model import FetchedSource, LiftReport, Provenance, SourceKind

__all__ = ["LiftTarget", "expand_braces", "select_files", "local_targets", "lift_target", "lift_source"]

log = logging.getLogger(__name__)
# triton imported directly or re-exported (vLLM: `from vllm.triton_utils import tl, triton`), or a jit kernel
_TRITON = re.compile(r"^\s*(?:(?:from|import)\s+triton\b|from\s+[\w.]+\s+import\s+.*\btriton\b|@(?:triton\.)?jit\b)", re.M)
_CPP_SUFFIXES = {".h", ".cuh", ".cu", ".hpp", ".cpp", ".cc", ".cxx"}


@dataclass(frozen=True)
class LiftTarget:
    path: Path
    lifter: str
    family: str


def select_files(manifest: Manifest, source: FetchedSource) -> tuple[list[LiftTarget], list[tuple[str, str]]]:
    """Targets in manifest order, and (pattern, reason) for patterns that matched nothing."""
    targets: list[LiftTarget] = []
    missing: list[tuple[str, str]] = []
    for rule in manifest.files:
        for pattern in expand_braces(rule.path):
            found = sorted(p for p in source.root.glob(pattern) if p.is_file())
            if not found:
                missing.append((pattern, f"no file in {manifest.filename} matches"))
            targets.extend(LiftTarget(p, rule.lifter, rule.family) for p in found)
    return targets, missing


def local_targets(source: FetchedSource) -> list[LiftTarget]:
    """One target per file read; a file no lifter takes gets lifter "none" and the reason as its family."""
    return [_local_target(p) for p in local_files(source.root / source.filename)]


def _local_target(p: Path) -> LiftTarget:
    if p.suffix in _CPP_SUFFIXES:
        return LiftTarget(p, "cuda", "local_cuda")
    if p.suffix != ".py":
        return LiftTarget(p, "none", "not a Python or CUDA/C++ source")
    head = p.read_text(encoding="utf-8", errors="replace")
    if re.search(r"^\s*(from|import)\s+cutlass(\.cute)?\b", head, re.M):
        return LiftTarget(p, "cute", "local_cute")
    if _TRITON.search(head):
        return LiftTarget(p, "triton", "local_triton")
    return LiftTarget(p, "none", "no Triton kernel (no @triton.jit function and no import of triton)")


def lift_target(target: LiftTarget, source: FetchedSource) -> LiftReport:
    """Run one lifter; a lifter module that is missing or fails is reported, not raised."""
    if target.lifter == "none":
        return LiftReport(_relative(target.path, source), skipped=(("file", target.family),))
    try:
        module = importlib.import_module(f"ingest.lift_{target.lifter}")
    except ImportError as err:
        return LiftReport(target.path.name, skipped=((str(target.path), f"lifter {target.lifter!r} unavailable: {err}"),))
    if target.lifter == "triton":  # the Triton lifter takes a provenance template instead of the source
        base = Provenance(source.distribution, source.version, _relative(target.path, source), 1, 1, "triton", str(getattr(module, "LIFTER_VERSION", "1")))
        return module.lift_file(target.path, base, family=target.family)
    return module.lift_file(target.path, source, family=target.family)


def _relative(path: Path, source: FetchedSource) -> str:
    try:
        return path.resolve().relative_to(source.root.resolve()).as_posix()
    except ValueError:
        return path.name


def lift_source(source: FetchedSource, manifest: Manifest | None = None) -> list[LiftReport]:
    missing: list[tuple[str, str]]
    if manifest is None or source.kind is SourceKind.LOCAL:
        targets, missing = local_targets(source), []
    else:
        targets, missing = select_files(manifest, source)
    reports = [lift_target(t, source) for t in targets]
    if missing:
        reports.append(LiftReport(manifest.name if manifest else source.filename, skipped=tuple(missing)))
    return reports
