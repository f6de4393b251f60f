"""The store's commands of `kb`: init, stats, show, doctor, export, import (thin shells over `kb.store`)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import typer
from rich.table import Table

from cli.app import app, esc, open_kb_of, out, settings_of

__all__ = ["init", "stats", "show", "doctor", "export_", "import_"]


@app.command()
def init(ctx: typer.Context) -> None:
    """Create the knowledge base (SQL schema and Chroma collections); safe to re-run."""
    with open_kb_of(ctx, create=True) as kb:
        out.print(f"kernel-kb ready: database {esc(kb.engines.target.display)}, embeddings {esc(kb.vectors.target.display)}")


@app.command()
def stats(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Rows per table and embeddings per Chroma collection (from KB_SERVICE_URL's `kb serve` when set)."""
    settings = settings_of(ctx)
    if settings.service_url:
        from cli.remote import call_service

        answer = call_service(settings, "GET", "/v1/stats")
    else:
        from cli.answers import stats_answer

        with open_kb_of(ctx) as kb:
            answer = stats_answer(kb)
    if as_json:
        out.print_json(json.dumps(answer))
        return
    table = Table("table", "rows", "embeddings", title="kernel-kb")
    for name, n in answer["rows"].items():
        vec = answer["vectors"].get(name)
        table.add_row(esc(name), str(n), "" if vec is None else str(vec))
    out.print(table)


@app.command()
def show(
    ctx: typer.Context,
    record_id: str = typer.Argument(..., metavar="ID", help="Any record id (k-…, s-…, src-…, t-…, p-…, r-…, a-…, l-…)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Print one record; kernels with IR text, features and provenance (from KB_SERVICE_URL's `kb serve` when set)."""
    settings = settings_of(ctx)
    if settings.service_url:
        from urllib.parse import quote

        from cli.remote import call_service

        answer = call_service(settings, "GET", f"/v1/records/{quote(record_id, safe='')}")
    else:
        from cli.answers import show_answer

        with open_kb_of(ctx) as kb:
            answer = show_answer(kb, record_id)
    if as_json:
        out.print_json(json.dumps(answer["record"]))
        return
    skip = ("ir_text", "features_json", "triton_src", "cuda_src") if answer["type"] == "Kernel" else ()
    _show_fields(answer, skip)
    if answer["type"] == "Kernel":
        _show_kernel(answer)


def _show_fields(answer: dict, skip: tuple[str, ...] = ()) -> None:
    data = answer["record"]
    out.print(f"[bold]{esc(answer['type'])} {esc(data.get('id'))}[/bold]")
    for name in answer["fields"]:  # declared order, not load order
        if name in skip or name == "id" or name not in data:
            continue
        text = str(data[name])
        out.print(f"  {name}: " + (text if "\n" not in text else "\n    " + text.replace("\n", "\n    ")), markup=False)


def _show_kernel(answer: dict) -> None:
    k = answer["record"]
    if answer["provenance"]:
        out.print(f"  provenance: {answer['provenance']}", markup=False)
    if len(answer["lineage"]) > 1:
        out.print("  lineage: " + " <- ".join(answer["lineage"]), markup=False)
    out.print("[bold]features[/bold]")
    try:
        out.print_json(k["features_json"])
    except json.JSONDecodeError:
        out.print(k["features_json"], markup=False)
    out.print("[bold]IR[/bold]")
    out.print(k["ir_text"], markup=False)


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
