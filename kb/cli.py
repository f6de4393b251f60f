"""The `kb` command line: a thin shell over `kb.store` (and, later, ingest/query/verify/generate).

Every command reads settings the same way (`kb.settings.load_settings`, with `--home`
overriding KB_HOME). A `KBError` from any command, including ones registered later on
`app`, prints one line on stderr and exits 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os

# OpenMP threads that spin after the embedding model's forward pass slow the vector query that
# follows (11.5 vs 4.5 ms at 10k kernels on 2 cores); must be set before torch loads libgomp
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import logging
import signal
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click
import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from kb.errors import KBError
from kb.settings import Settings, load_settings

if TYPE_CHECKING:
    from sqlmodel import SQLModel

__all__ = ["app", "main", "settings_of"]

out = Console(highlight=False, soft_wrap=True)


class _KBGroup(TyperGroup):
    """Turns `KBError` into one line on stderr and exit status 1, and a stop into one line and 128 + signal.

    SIGTERM raises KeyboardInterrupt like Ctrl-C, so both unwind through every `finally` (the
    verify runner kills its candidate there, generate records its run as interrupted). A command
    says what it kept as the KeyboardInterrupt's message: `kb: interrupted: <message>`.
    """

    def invoke(self, ctx: click.Context):  # noqa: ANN201
        caught: list[int] = []

        def on_sigterm(signum: int, frame: object) -> None:
            caught.append(signum)
            raise KeyboardInterrupt

        previous = _set_handler(signal.SIGTERM, on_sigterm)
        try:
            return super().invoke(ctx)
        except KBError as err:
            click.echo(f"kb: error: {err}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt as err:
            click.echo(f"kb: interrupted: {err}" if str(err) else "kb: interrupted", err=True)
            ctx.exit(128 + (caught[0] if caught else signal.SIGINT))
        finally:
            if previous is not None:
                _set_handler(signal.SIGTERM, previous)


def _set_handler(signum: int, handler):  # noqa: ANN001, ANN202
    """signal.signal, or None where it cannot be set (not the main thread)."""
    try:
        return signal.signal(signum, handler)
    except ValueError:
        return None


app = typer.Typer(
    cls=_KBGroup,
    help="kernel-kb: a knowledge base of expert GPU attention kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _root(
    ctx: typer.Context,
    home: Path | None = typer.Option(None, "--home", help="KB directory (overrides KB_HOME)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress to stderr."),
) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = load_settings(home=home)


def settings_of(ctx: typer.Context) -> Settings:
    """The settings the root callback loaded (for commands registered elsewhere)."""
    return ctx.find_root().obj


def _open(ctx: typer.Context, create: bool = False):  # -> KnowledgeBase
    from kb.store import open_kb

    return open_kb(settings_of(ctx), create=create)


@app.command()
def init(ctx: typer.Context) -> None:
    """Create the knowledge base (SQL schema and Chroma collections); safe to re-run."""
    with _open(ctx, create=True) as kb:
        out.print(f"kernel-kb ready: database {kb.engines.target.display}, embeddings {kb.vectors.target.display}")


@app.command()
def stats(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Rows per table and embeddings per Chroma collection."""
    with _open(ctx) as kb:
        counts = kb.counts()
    if as_json:
        out.print_json(json.dumps({"rows": dict(counts.rows), "vectors": dict(counts.vectors)}))
        return
    table = Table("table", "rows", "embeddings", title="kernel-kb")
    for name, n in counts.rows.items():
        vec = counts.vectors.get(name)
        table.add_row(name, str(n), "" if vec is None else str(vec))
    out.print(table)


@app.command()
def show(
    ctx: typer.Context,
    record_id: str = typer.Argument(..., metavar="ID", help="Any record id (k-…, s-…, src-…, t-…, p-…, r-…, a-…, l-…)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Print one record; kernels with IR text, features and provenance."""
    from kb.store import Kernel

    with _open(ctx) as kb:
        rec = kb.get(record_id)
        if as_json:
            out.print_json(json.dumps(rec.model_dump(mode="json")))
            return
        if isinstance(rec, Kernel):
            _show_kernel(kb, rec)
        else:
            _show_fields(rec)


def _show_fields(rec: SQLModel, skip: tuple[str, ...] = ()) -> None:
    out.print(f"[bold]{type(rec).__name__} {rec.id}[/bold]")  # type: ignore[attr-defined]
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
        out.print("  lineage: " + " <- ".join(c.id for c in chain))
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
    fix: bool = typer.Option(False, "--fix", help="Repair: embed missing rows, delete orphan embeddings, recompute hashes, "
                                                "mark dead runs interrupted, cut broken lineage links, remove orphaned temp dirs."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Check the KB: SQL vs Chroma drift, hashes, lineage, runs whose process died, orphaned verify temp dirs; exit 1 if any remain unfixed."""
    from kb.store.doctor import run_doctor

    with _open(ctx) as kb:
        report = run_doctor(kb, fix=fix, temp_root=Path(tempfile.gettempdir()))
    if as_json:
        issues = [{"kind": d.kind.value, "table": d.table, "id": d.id, "detail": d.detail} for d in report.issues]
        out.print_json(json.dumps({"ok": report.ok, "fixed": report.fixed, "issues": issues}))
    else:
        for d in report.issues:
            out.print(f"  {d.kind.value:18} {d.table:15} {d.id} {d.detail}", markup=False)
        out.print(report.summary())
    if not report.ok and not report.fixed:
        raise typer.Exit(1)


@app.command("export")
def export_(ctx: typer.Context, file: Path = typer.Argument(..., help="JSONL file to write.")) -> None:
    """Dump every row to a portable JSONL file (one record per line)."""
    with _open(ctx) as kb:
        counts = kb.export_jsonl(file)
    out.print(f"exported {sum(counts.values())} records to {file}")


@app.command("import")
def import_(ctx: typer.Context, file: Path = typer.Argument(..., help="JSONL file from `kb export`.")) -> None:
    """Load a JSONL dump (idempotent) and embed its kernels, snippets and lessons."""
    with _open(ctx, create=True) as kb:
        counts = kb.import_jsonl(file)
    out.print(f"imported {sum(counts.values())} records from {file}")


# the working commands (ingest, query, verify, generate, bench) register themselves on `app`
from kb import cli_tune, cli_work  # noqa: E402,F401


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # `python -m kb.cli`: run the imported module, whose app holds every command
    from kb.cli import main as _main

    _main()
