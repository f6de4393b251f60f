"""Rendering a VerifyResult for people: a rich table (JSON is `VerifyResult.to_json`)."""

from __future__ import annotations

from rich.table import Table

from verify.result import VerifyResult

__all__ = ["result_table"]


def result_table(r: VerifyResult) -> Table:
    colour = "green" if r.passed else "red"
    table = Table(title=f"kb verify: [{colour}]{r.verdict.value}[/{colour}]", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows = [("message", r.message), ("spec", r.spec), ("candidate", r.candidate),
            ("mode", "torch baseline" if r.torch_baseline else "kernel (torch compute ops forbidden)"),
            ("device", r.device), ("seed", str(r.seed)), ("calls", str(r.calls)),
            ("shapes", "; ".join(c.label() for c in r.cases) or "-"), ("distributions", ", ".join(r.distributions) or "-"),
            ("max abs / rel error", f"{r.max_abs_err:.3g} / {r.max_rel_err:.3g}")]
    if r.finding is not None and r.finding.op:
        rows.append(("caught", r.finding.op))
    if r.finding is not None and r.finding.phase == "backward":
        rows.append(("in", "backward" + (f", gradient {r.finding.grad}" if r.finding.grad else "")))
    b = r.backward
    if b is not None:
        rows.append(("gradients", f"{', '.join(b.grads)} on {b.calls} backward calls; max error "
                                  f"{b.max_abs_err:.3g} x max(1, max|ref|); eager torch in the spec's dtype "
                                  f"{b.max_torch_err:.3g} (allowed: dtype table + {b.slack:g}x that)"))
    if r.memory is not None:
        rows.append(("peak memory", f"candidate {r.memory.candidate_peak_mib:.1f} MiB, reference "
                                    f"{r.memory.reference_peak_mib:.1f} MiB ({r.memory.method})"))
    t = r.timing
    if t is not None:
        rows.append(("timing", f"candidate {t.candidate_ms:.4f} ms (IQR {t.candidate_iqr_ms:.4f}), baseline "
                               f"{t.baseline_ms:.4f} ms, limit {t.limit_ms or 0:.4f} ms" if t.timed else t.reason))
    if r.isolation is not None:
        rows.append(("sandbox", r.isolation.summary()))
        rows += [("sandbox missing", m) for m in r.isolation.missing]
    rows += [("score", f"{r.score:.3f}"), ("duration", f"{r.duration_s:.1f} s")]
    rows += [("note", n) for n in r.notes]
    for name, value in rows:
        table.add_row(name, value)
    return table
