"""CUDA C++ lifter: tree-sitter regions -> snippets (ingest.cuda_rules) and launch code -> tunables.

`lift_file` never raises on bad input: an unreadable or undecodable file, or one that yields
nothing, is reported in `LiftReport.skipped`. Parse errors are tolerated (tree-sitter recovers);
their count is reported as a skipped note when the file still yields regions.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ingest.cuda_rules import Rule, match_rule
from ingest.cuda_tree import CudaFile, Region, parse_cuda
from ingest.cuda_tunables import cutlass_runner_tunables, fa2_bwd_launch_tunables, fa2_launch_tunables
from ingest.model import FetchedSource, LiftedSnippet, LiftedTunable, LiftReport, Provenance

__all__ = ["lift_file", "LIFTER", "LIFTER_VERSION", "FAMILY_ARCH"]

log = logging.getLogger(__name__)
# Code of the backward pass (FA2's dq/dk/dv kernels, its preprocess and conversions, its launch): snippets there
# carry the `backward` feature whichever rule matched them.
BACKWARD_SCOPE = re.compile(r"compute_dq_dk_dv|dot_do_o|convert_d(Q|KV)|clear_dKVaccum|run_mha_bwd|run_flash_bwd|Flash_bwd")
LIFTER = "cuda"
LIFTER_VERSION = "1"
# The arch a family's kernels target (a feature of every snippet lifted from it).
FAMILY_ARCH = {"fa2_cuda": "sm80", "cutlass_fmha_sm80": "sm80", "cutlass_fmha_sm90": "sm90", "cutlass_fmha_sm100": "sm100"}


def _rel(path: Path, source: FetchedSource | None) -> str:
    if source is not None:
        try:
            return path.resolve().relative_to(source.root.resolve()).as_posix()
        except ValueError:
            pass
    return path.name


def _select(f: CudaFile) -> list[tuple[Rule, Region]]:
    """First matching rule per region; one per (rule, scope) where asked; drop same-rule nesting."""
    picked: list[tuple[Rule, Region]] = []
    seen_scope: set[tuple[str, str]] = set()
    for region in f.regions():
        rule = match_rule(region, f.excerpt(region.line_start, region.line_end))
        if rule is None:
            continue
        if rule.once_per_scope:
            if (rule.name, region.scope) in seen_scope:
                continue
            seen_scope.add((rule.name, region.scope))
        picked.append((rule, region))
    return [(r, g) for r, g in picked
            if not any(r2.name == r.name and g2 is not g and g2.line_start <= g.line_start and g.line_end <= g2.line_end
                       and (g2.line_start, g2.line_end) != (g.line_start, g.line_end) for r2, g2 in picked)]


def lift_file(path: Path, source: FetchedSource | None = None, family: str = "fa2_cuda") -> LiftReport:
    """Lift one C++/CUDA file; `source` gives provenance (distribution, version, root)."""
    rel = _rel(Path(path), source)
    dist, version = (source.distribution, source.version) if source else ("local", "0")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        return LiftReport(rel, skipped=((rel, f"cannot read: {err}"),))
    f = parse_cuda(text)
    skipped: list[tuple[str, str]] = []
    if f.error_count:
        skipped.append((rel, f"{f.error_count} parse error nodes tolerated"))

    def prov(a: int, b: int) -> Provenance:
        return Provenance(dist, version, rel, a, b, LIFTER, LIFTER_VERSION)

    arch = FAMILY_ARCH.get(family, "any")
    snippets = []
    for rule, region in _select(f):
        feats = {**rule.features, **({"arch": arch} if arch != "any" else {})}
        if BACKWARD_SCOPE.search(region.scope) or BACKWARD_SCOPE.search(region.head if region.kind.value == "function" else ""):
            feats["backward"] = True  # a forward rule's region inside backward code (e.g. BlockInfo, the GQA head)
        title = f"{rule.title} [{region.scope + '::' if region.scope else ''}{_short(region)}]"
        snippets.append(LiftedSnippet(rule.snippet_kind, title, rule.ir, f.excerpt(region.line_start, region.line_end),
                                      feats, prov(region.line_start, region.line_end)))
    tunables = [LiftedTunable(family + sfx, a or arch, hd, dt, params, cond, prov(s, e))
                for a, hd, dt, params, cond, s, e, sfx in fa2_launch_tunables(f) + fa2_bwd_launch_tunables(f)
                + cutlass_runner_tunables(f)]
    if not snippets and not tunables:
        skipped.append((rel, "no known region (mask, softmax, score mod, split-KV, paged, varlen, launch tiles) found"))
    log.info("lifted %s: %d snippets, %d tunables", rel, len(snippets), len(tunables))
    return LiftReport(rel, (), tuple(snippets), tuple(tunables), tuple(skipped), _backward(snippets, tunables))


def _backward(snippets: list[LiftedSnippet], tunables: list[LiftedTunable]) -> tuple[tuple[str, str], ...]:
    """Coverage lines for the backward pass: its regions (snippets) and launch tiles (tunables)."""
    out = []
    bs = [s for s in snippets if s.features.get("backward")]
    if bs:
        out.append(("regions", f"{len(bs)} backward snippets ({', '.join(sorted({s.kind for s in bs}))})"))
    bt = [t for t in tunables if t.params.get("direction") == "backward"]
    if bt:
        dims = sorted({t.head_dim for t in bt})
        out.append(("launch tiles", f"{len(bt)} backward tunables (head dims {dims}, archs {sorted({t.arch for t in bt})})"))
    return tuple(out)


def _short(region: Region) -> str:
    head = region.head if len(region.head) <= 60 else region.head[:57] + "..."
    return f"{region.kind.value} {head}"
