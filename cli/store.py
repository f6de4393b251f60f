"""The store's commands of `kb`: init, stats, show, doctor, export, import (thin shells over `kb.store`)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from cli.app import app, esc, open_kb_of, out

if TYPE_CHECKING:
    from sqlmodel import SQLModel

__all__ = ["init", "stats", "show", "doctor", "export_", "import_"]


@app.command()
def init(ctx: typer.Context) -> None:
    """Create the knowledge base (SQL schema and Chroma collections); safe to re-run."""
    with open_kb_of(ctx, create=True) as kb:
        out.print(f"kernel-kb ready: database {esc(kb.engines.target.display)}, embeddings {esc(kb.vectors.target.display)}")


@app.command()
def stats(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Rows per table and embeddings per Chroma collection."""
    with open_kb_of(ctx) as kb:
        counts = kb.counts()
    if as_json:
        out.print_json(json.dumps({"rows": dict(counts.rows), "vectors": dict(counts.vectors)}))
        return
    table = Table("table", "rows", "embeddings", title="kernel-kb")
    for name, n in counts.rows.items():
        vec = counts.vectors.get(name)
        table.add_row(esc(name), str(n), "" if vec is None else str(vec))
    out.print(table)


@app.command()
def show(
    ctx: typer.Context,
    record_id: str = typer.Argument(..., metavar="ID", help="Any record id (k-…, s-…, src-…, t-…, p-…, r-…, a-…, l-…)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Print one record; kernels with IR text, features and provenance."""
    from kb.store import Kernel

    with open_kb_of(ctx) as kb:
        rec = kb.get(record_id)
        if as_json:
            out.print_json(json.dumps(rec.model_dump(mode="json")))
            return
        if isinstance(rec, Kernel):
            _show_kernel(kb, rec)
        else:
            _show_fields(rec)


def _show_fields(rec: SQLModel, skip: tuple[str, ...] = ()) -> None:
    out.print(f"[bold]{type(rec).__name__} {esc(rec.id)}[/bold]")  # type: ignore[attr-defined]
    data = rec.model_dump(mode="json")
    for name in type(rec).model_fields:  # declared order, not load order
        if name in skip or name == "id":
            continue
        text = str(data[name])
        out.print(f"  {name}: " + (text if "\n" not in text else "\n    " + text.replace("\n", "\n    ")), markup=False)


def _show_kernel(kb, k) -> None:  # noqa: ANN001
    from kb.store import Source

    _show_fields(k, skip=("ir_text", "features_json", "triton_src", "cuda_src"))
    src = kb.find(k.source_id) if k.source_id else None
    if isinstance(src, Source):
        span = f":{k.line_start}-{k.line_end}" if k.line_start else ""
        out.print(f"  provenance: {src.distribution}=={src.version} ({src.kind}) {k.file}{span} lifter {k.lifter_version or '?'}", markup=False)
    chain = kb.lineage(k.id)
    if len(chain) > 1:
        out.print("  lineage: " + " <- ".join(c.id for c in chain), markup=False)
    out.print("[bold]features[/bold]")
    try:
        out.print_json(k.features_json)
    except json.JSONDecodeError:
        out.print(k.features_json, markup=False)
    out.print("[bold]IR[/bold]")
    out.print(k.ir_text, markup=False)


@app.command()
def doctor(
    ctx: typer.Context,
    fix: bool = typer.Option(False, "--fix", help="Repair: embed missing rows, delete orphan embeddings, quarantine records "
                                                "that break a rule (hash or id mismatch included), mark dead runs "
                                                "interrupted, cut broken lineage links, remove orphaned temp dirs."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Check the KB: SQL vs Chroma drift, records that break a rule, hashes, lineage, runs whose process died, orphaned
    verify temp dirs; exit 1 if any remain unfixed."""
    from kb.store.doctor import run_doctor

    with open_kb_of(ctx) as kb:
        report = run_doctor(kb, fix=fix, temp_root=Path(tempfile.gettempdir()))
    if as_json:
        issues = [{"kind": d.kind.value, "table": d.table, "id": d.id, "detail": d.detail} for d in report.issues]
        out.print_json(json.dumps({"ok": report.ok, "fixed": report.fixed, "issues": issues,
                                   "quarantined": dict(report.quarantined)}))
    else:
        for d in report.issues:
            out.print(f"  {d.kind.value:18} {d.table:15} {d.id} {d.detail}", markup=False)
        out.print(report.summary(), markup=False)
    if not report.ok and not report.fixed:
        raise typer.Exit(1)


@app.command("export")
def export_(ctx: typer.Context, file: Path = typer.Argument(..., help="JSONL file to write.")) -> None:
    """Dump every row to a portable JSONL file (one record per line)."""
    with open_kb_of(ctx) as kb:
        counts = kb.export_jsonl(file)
    out.print(f"exported {sum(counts.values())} records to {file}", markup=False)


@app.command("import")
def import_(ctx: typer.Context, file: Path = typer.Argument(..., help="JSONL file from `kb export`.")) -> None:
    """Load a JSONL dump (idempotent) and embed its kernels, snippets and lessons."""
    with open_kb_of(ctx, create=True) as kb:
        counts = kb.import_jsonl(file)
    out.print(f"imported {sum(counts.values())} records from {file}", markup=False)
