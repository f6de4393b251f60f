"""The working commands of `kb`: ingest, query, verify, generate (registered on `cli.app.app`; tune, bench
and perf import live in cli.tune).

Each is a thin shell over a plain function (`ingest.run.ingest`, `retrieve.hybrid.query`,
`verify.cli.verify_command`, `generate.pipeline.generate`).
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from cli.app import app, err, esc, open_kb_of, out, settings_of
from generate.stages import ReportStatus
from kb.errors import KBError

if TYPE_CHECKING:
    from generate.pipeline import GenerateOptions, GenerateResult
    from kb.store import KnowledgeBase

__all__ = ["ingest_cmd", "query_cmd", "generate_cmd"]


@app.command("ingest")
def ingest_cmd(
    ctx: typer.Context,
    sources: list[str] = typer.Argument(None, help="Corpus manifest names (see corpus/), pypi:DIST==VER, or local paths."),
    all_: bool = typer.Option(False, "--all", help="Ingest every manifest in corpus/."),
    as_json: bool = typer.Option(False, "--json", help="Print the coverage as JSON."),
) -> None:
    """Download pinned expert releases (or read local kernels), lift them into IR programs, snippets and tunables, and store them.

    Re-ingesting the same release is a no-op; ends with a coverage table per file."""
    from ingest.manifest import list_manifests
    from ingest.run import ingest

    names = [m.name for m in list_manifests()] if all_ else list(sources or [])
    if not names:
        raise KBError("nothing to ingest: give SOURCE... or --all", hint="`kb ingest --all` ingests corpus/*.toml")
    kb = open_kb_of(ctx, create=True)
    summary = ingest(kb, names, progress=not as_json)
    measured = None
    if all_:  # and the designs measured on the GPUs we have (corpus/measured/*.json, with their provenance)
        from generate.perf_import import import_corpus

        measured = import_corpus(kb)
    if as_json:
        out.print_json(json.dumps({"seconds": summary.seconds, "totals": summary.totals(),
                                   "files": [{"source": s.source, **f.__dict__} for s in summary.sources for f in s.files],
                                   "measured": measured.__dict__ if measured is not None else None}))
        return
    table = Table(title="ingest coverage", show_lines=False)
    for col in ("source", "file", "programs (verified)", "snippets", "tunables", "new rows", "skipped (reason)"):
        table.add_column(col, overflow="fold")  # a terminal wraps a long path; a pipe gets it on one line
    for s in summary.sources:
        for f in s.files:
            skipped = "; ".join(f"{w}: {r}" for w, r in f.skipped[:2]) + (
                f" (+{len(f.skipped) - 2} more; --json)" if len(f.skipped) > 2 else "")
            table.add_row(esc(s.source), esc(f.file), f"{f.programs} ({f.verified})", str(f.snippets), str(f.tunables),
                          str(f.new_rows), esc(skipped))
    out.print(table)
    for s in summary.sources:  # the backward pass: kernels lifted into programs, regions into snippets, or why not
        for f in s.files:
            for what, status in f.backward:
                out.print(f"backward {f.file} {what}: {status}", markup=False)
    t = summary.totals()
    out.print(f"{t['programs']} programs ({t['verified']} verified by the interpreter), {t['snippets']} snippets, "
              f"{t['tunables']} tunables, {t['new_rows']} new rows, {t['skipped']} skipped items in {summary.seconds:.1f}s")
    if measured is not None:
        out.print(f"measured designs from corpus/measured: {measured.perf_records} records, {measured.lessons} lessons, "
                  f"{measured.kernels_added} new kernels")


@app.command("query")
def query_cmd(
    ctx: typer.Context,
    spec_or_text: str = typer.Argument(..., help="A spec file (KernelBench Model or score_mod/mask_mod) or free text."),
    k: int = typer.Option(5, "-k", help="How many kernels to list (1-100)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    mode: str = typer.Option("hybrid", help="hybrid | embedding | structural."),
    arch: str = typer.Option(None, help="Only kernels for this arch (sm80, sm90, ...) or arch-neutral ones."),
    dtype: str = typer.Option(None, help="Only kernels of this dtype."),
    head_dim: int = typer.Option(None, "--head-dim", help="Only kernels for this head dim."),
    no_memory: bool = typer.Option(False, "--no-memory", help="Ignore generated kernels and lessons."),
) -> None:
    """Find the nearest reference kernels and the snippets a transfer would need, with each ranking term.

    With KB_SERVICE_URL set, the query goes to that `kb serve` (a spec file is sent as text and traced there)."""
    from cli.answers import check_query_args

    check_query_args(k, mode)
    path = Path(spec_or_text)
    if _looks_like_path(spec_or_text) and not path.is_file():
        raise KBError(f"spec file {spec_or_text} does not exist" if not path.exists() else f"{spec_or_text} is not a spec file",
                      hint="an argument with a '/' and no spaces, or ending in .py, is read as a spec path")
    is_spec = path.suffix == ".py" or path.is_file()
    options = {"k": k, "mode": mode, "arch": arch, "dtype": dtype, "head_dim": head_dim, "memory": not no_memory}
    settings = settings_of(ctx)
    if settings.service_url:
        from cli.remote import call_service

        body = {"spec": _read_spec_text(path), "filename": path.name} if is_spec else {"text": spec_or_text}
        answer = call_service(settings, "POST", "/v1/query", {**body, **options})
    else:
        from cli.answers import query_answer

        target, text = None, spec_or_text
        with contextlib.ExitStack() as stack:
            if is_spec:
                from generate.spec_cache import start_trace

                traced = stack.enter_context(start_trace(path, settings.cache_dir))  # torch imports in a child ...
            kb = stack.enter_context(open_kb_of(ctx))  # ... while the KB opens here
            if is_spec:
                from retrieve.hybrid import describe_target

                spec = traced.result()
                target, text = spec.features, describe_target(spec.features, spec.score_mod, spec.mask_mod)
            answer = query_answer(kb, text, target, **options)  # type: ignore[arg-type]
    if as_json:
        out.print_json(json.dumps(answer))
        return
    render_query(answer)


def _read_spec_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise KBError(f"cannot read spec file {path}: {err}") from None


def render_query(answer: dict) -> None:
    """The tables `kb query` prints, from a query answer (cli.answers.query_answer, local or from the service)."""
    out.print(f"query: {answer['query']}", markup=False)
    table = Table(title=f"top {answer['k']} kernels ({esc(answer['mode'])})")
    for col in ("#", "id", "name", "family", "score", "terms"):
        table.add_column(col)
    for i, r in enumerate(answer["kernels"], 1):
        top = sorted(r["terms"].items(), key=lambda kv: -abs(kv[1]))
        terms = ", ".join(f"{t} {v:+.2f}" for t, v in top[:4]) + (f" (+{len(top) - 4} more; --json)" if len(top) > 4 else "")
        table.add_row(str(i), esc(r["id"]), esc(r["name"]), esc(f"{r['family']} ({r['origin']})"), f"{r['score']:.2f}",
                      esc(terms))
    out.print(table)
    if answer["snippets"]:
        st = Table(title="snippets a transfer needs")
        for col in ("kind", "title", "IR meaning", "from"):
            st.add_column(col)
        for s in answer["snippets"]:
            st.add_row(esc(s["kind"]), esc(s["title"]), esc(s["ir_text"][:70]), esc(s["where"]))
        out.print(st)
    for les in answer["lessons"]:
        out.print(f"lesson: {les}", markup=False)


def _looks_like_path(arg: str) -> bool:
    """A spec path rather than free text: ends in .py, or has a '/' and no whitespace ("causal w/ softcap" is text)."""
    return arg.endswith(".py") or ("/" in arg and not any(c.isspace() for c in arg))


def _verify_cmd() -> None:
    from verify.cli import verify_command

    @functools.wraps(verify_command)
    def verify_cmd(*args, **kwargs) -> None:
        code = verify_command(*args, **kwargs)
        if code:
            raise typer.Exit(code)

    app.command("verify", help="Verify a KernelBench candidate (ModelNew) against a spec (Model); exit 0 only on a pass.")(verify_cmd)


_verify_cmd()


@app.command("generate")
def generate_cmd(
    ctx: typer.Context,
    specs: list[Path] = typer.Argument(None, help="Spec files."),
    all_dir: Path = typer.Option(None, "--all", help="Generate for every *.py spec in this directory."),
    out_dir: Path = typer.Option(Path("out"), "--out", help="Where candidate, Triton, CUDA, IR and report files go."),
    engine: str = typer.Option("rule", help="rule (offline, default) or llm (KB_LLM_BASE_URL / KB_LLM_MODEL)."),
    no_memory: bool = typer.Option(False, "--no-memory", help="Ignore written-back kernels and lessons."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the verify harness on the lowered kernel."),
    no_backward: bool = typer.Option(False, "--no-backward",
                                     help="Forward only: no backward kernels; ModelNew is then not differentiable."),
    deterministic: bool = typer.Option(False, "--deterministic",
                                       help="Only a backward whose gradients are bitwise reproducible run to run (no "
                                            "atomics: dq in a pass of its own; learnable tables then get no backward)."),
    max_attempts: int = typer.Option(6, help="Attempts per spec."),
    timeout: float = typer.Option(None, "--timeout", metavar="SECONDS",
                                  help="Budget per spec for all its attempts; each verify gets what is left [default: KB_VERIFY_TIMEOUT, 600]."),
    target: str = typer.Option("auto", "--target", metavar="ARCH",
                               help="GPU arch the emitted designs are chosen for: sm90, sm80, ... or auto "
                                    "(this machine's GPU, else KB_TARGET_ARCH, default sm90)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (per spec: status, kernel, files) "
                                                       "on stdout; failures and progress still go to stderr."),
    force: bool = typer.Option(False, "--force", help="Regenerate even when the cache holds this spec's kernel "
                                                      "(an unchanged spec, code, options and KB knowledge)."),
    use_ray: bool = typer.Option(False, "--ray", help="Run each spec as a task on a Ray cluster, writing to the shared "
                                                      "KB (KB_DB_URL PostgreSQL + KB_CHROMA_URL server); needs ray."),
    ray_address: str = typer.Option(None, "--ray-address", metavar="ADDRESS",
                                    help="The Ray cluster for --ray (as `ray.init` takes it, e.g. 10.0.0.5:6379) "
                                         "[default: RAY_ADDRESS, else a local cluster on this machine's CPUs]."),
    ray_retries: int = typer.Option(2, "--ray-retries", help="Times a spec is resubmitted after its Ray worker dies."),
) -> None:
    """Generate verified kernels: retrieve a reference, transfer, check the IR, lower to Triton and CUDA, verify, write back.

    An unchanged spec whose kernel the cache holds gets its files back without generating (--force: regenerate).
    With --ray the specs run as tasks on a Ray cluster, as many at once as it has CPUs, with the same files and
    report as a local run (README: "Campaigns on a Ray cluster")."""
    from generate.pipeline import GenerateOptions, resolve_target

    if engine not in ("rule", "llm"):
        raise KBError(f"unknown --engine {engine!r}; use rule or llm")
    if deterministic and no_backward:
        raise KBError("--deterministic is about the backward; it makes no sense with --no-backward")
    paths = list(specs or [])
    if all_dir is not None:
        if not all_dir.is_dir():
            raise KBError(f"--all {all_dir}: not a directory")
        paths += sorted(p for p in all_dir.glob("*.py") if not p.name.startswith("_"))
    if not paths:
        raise KBError("nothing to generate: give SPEC... or --all DIR")
    for p in paths:
        if not p.is_file():
            raise KBError(f"spec file {p} does not exist")
    settings = settings_of(ctx) if timeout is None else replace(settings_of(ctx), verify_timeout=timeout)
    kb = open_kb_of(ctx)
    opts = GenerateOptions(engine=engine, memory=not no_memory, out_dir=out_dir, verify_kernel=not no_verify,  # type: ignore[arg-type]
                           max_attempts=max_attempts, timeout_s=settings.verify_timeout,
                           target=resolve_target(target, settings.target_arch), backward=not no_backward,
                           deterministic=deterministic)
    if ray_address is not None and not use_ray:
        raise KBError("--ray-address is for --ray campaigns; add --ray")
    if ray_retries < 0:
        raise KBError("--ray-retries must be 0 or more")
    if use_ray:
        results = _generate_on_ray(kb, paths, opts, force, ray_address, ray_retries, backward_asked=not no_backward)
    else:
        results = _generate_here(kb, paths, opts, force, backward_asked=not no_backward)
    if as_json:
        typer.echo(json.dumps({"specs": [_generate_json(r) for r in results],
                               "failed": sum(not r.succeeded for r in results)}, indent=2))
    else:
        _print_generated(results)
    if any(not r.succeeded for r in results):
        raise typer.Exit(1)


def _generate_here(kb: KnowledgeBase, paths: list[Path], opts: GenerateOptions, force: bool, *,
                   backward_asked: bool) -> list[GenerateResult]:
    from generate.cache import generate_cached

    results: list[GenerateResult] = []
    for p in paths:
        with err.status(f"generating {esc(p)} …"):
            try:
                r = generate_cached(kb, p, opts, force=force)
            except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM (cli.app maps it): say what the earlier specs kept
                kept = f"; {len(results)} earlier spec(s) finished and kept" if results else ""
                raise KeyboardInterrupt(f"{stop or 'stopped'}{kept}") from stop
        results.append(r)
        for line in _generate_problems(r, backward_asked=backward_asked):  # as they happen, on stderr
            err.print(line, markup=False)
    return results


def _generate_on_ray(kb: KnowledgeBase, paths: list[Path], opts: GenerateOptions, force: bool, address: str | None,
                     retries: int, *, backward_asked: bool) -> list[GenerateResult]:
    from generate.campaign import run_campaign

    with err.status(f"generating {len(paths)} spec(s) on Ray …") as status:
        def done(r: GenerateResult, finished: int, total: int) -> None:
            status.update(f"generating on Ray: {finished}/{total} spec(s) finished …")
            err.print(f"{r.spec_path}: {r.status}" + (f" ({r.kernel_id})" if r.kernel_id else ""), markup=False)
            for line in _generate_problems(r, backward_asked=backward_asked):
                err.print(line, markup=False)

        report = run_campaign(kb, paths, opts, address=address, force=force, retries=retries, on_done=done)
    if report.retried:
        err.print(f"{report.retried} task(s) resubmitted after their Ray worker died (their runs are marked "
                  "interrupted)", markup=False)
    return report.results


def _generate_problems(r: GenerateResult, *, backward_asked: bool) -> list[str]:
    """What went wrong with one spec, for stderr: why it failed, or why its ModelNew is forward-only."""
    if not r.succeeded:
        tried = f" after {len(r.attempts)} attempt(s)" if r.attempts else ""  # none: refused before any attempt
        report = f" (report: {r.files['report']})" if "report" in r.files else ""
        return [f"{r.spec_path}: failed{tried}: {r.error}{report}"]
    if r.backward == ReportStatus.NONE and backward_asked:
        return [f"{r.spec_path}: no backward ({r.backward_reason}); ModelNew is forward-only"]
    return []


def _generate_json(r: GenerateResult) -> dict:
    return {"spec": str(r.spec_path), "status": str(r.status), "kernel_id": r.kernel_id, "run_id": r.run_id,
            "backward": {"status": str(r.backward), "reason": r.backward_reason}, "attempts": len(r.attempts),
            "seconds": round(r.seconds, 3), "error": r.error, "files": {kind: str(f) for kind, f in r.files.items()},
            "cached": {"run_id": r.cached.run_id, "key": r.cached.key} if r.cached else None}


def _print_generated(results: list[GenerateResult]) -> None:
    """The specs that produced a kernel, as a table and one line each (failures went to stderr)."""
    made = [r for r in results if r.succeeded]
    if made:
        table = Table(title="generate")
        for col in ("spec", "result", "backward", "attempts", "kernel", "seconds", "candidate"):
            table.add_column(col, overflow="fold")  # a terminal wraps a long path; a pipe gets it on one line
        for r in made:
            table.add_row(esc(r.spec_path), _STATUS_STYLE.get(r.status, "{}").format(esc(r.status)) + (" (cached)" if r.cached else ""),
                          _STATUS_STYLE.get(r.backward, "{}").format(esc(r.backward)), str(len(r.attempts)),
                          esc(r.kernel_id or "-"), f"{r.seconds:.1f}", esc(r.files["candidate"]))
        out.print(table)
    for r in made:
        cached = f"; from the cache, made by run {r.cached.run_id} (--force regenerates)" if r.cached else ""
        out.print(f"{r.spec_path}: kernel {r.kernel_id} -> {r.files['candidate']} (Triton: {r.files['triton'].name}){cached}",
                  markup=False)
    written = sorted({str(f.parent) for r in results for f in r.files.values()})
    if written:
        out.print(f"outputs in {', '.join(written)} (each spec's .report.json says what its files are)", markup=False)


_STATUS_STYLE = {ReportStatus.VERIFIED: "[green]{}[/]", ReportStatus.UNVERIFIED: "[yellow]{}[/]",
                 ReportStatus.FAILED: "[red]{}[/]", ReportStatus.NONE: "[yellow]{}[/]"}
