"""`kb tune` and `kb perf import`: designs measured on a GPU, written back as performance memory.

Both are thin shells over `generate.tune` (plans, the design order), `bench.gpu.tune` (the timing)
and `generate.perf_import` (the one-transaction write-back).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.table import Table

from cli.app import app, err, esc, open_kb_of, out, settings_of
from kb.errors import KBError

__all__ = ["tune_cmd", "perf_import_cmd", "bench_cmd"]

perf_app = typer.Typer(help="Measured performance records: import what a GPU machine measured.", no_args_is_help=True)
app.add_typer(perf_app, name="perf")


@app.command("tune")
def tune_cmd(
    ctx: typer.Context,
    targets: list[str] = typer.Argument(..., help="Spec files or directories of specs (tuned at their BENCH shapes), "
                                                  "or generated kernel ids (k-…)."),
    from_dir: Path = typer.Option(Path("out"), "--from", help="The --out directory `kb generate` wrote the candidates to."),
    plan: Path = typer.Option(None, "--plan", help="Write the work to this plan file instead of timing (no GPU needed)."),
    target: str = typer.Option("auto", "--target", metavar="ARCH", help="Arch whose memory orders the designs (plans only; "
                                                                       "on a GPU, the GPU's own). auto: KB_TARGET_ARCH."),
    max_designs: int = typer.Option(10, "--max-designs", help="Designs timed per spec and shape, most promising first."),
    no_memory: bool = typer.Option(False, "--no-memory", help="Order designs by expert tunables and the default grid only."),
    backward: bool = typer.Option(False, "--backward", help="Tune the backward's designs instead: each timed as one "
                                                            "training step (forward as emitted, gradients checked)."),
    results: Path = typer.Option(None, "--results", help="Also keep the raw results document here (JSON)."),
    as_json: bool = typer.Option(False, "--json", help="Print the results document as JSON."),
    use_ray: bool = typer.Option(False, "--ray", help="Time each spec as a task with a GPU of its own (num_gpus=1) on a "
                                                      "Ray cluster; this machine needs no GPU. Needs ray."),
    ray_address: str = typer.Option(None, "--ray-address", metavar="ADDRESS",
                                    help="The Ray cluster for --ray [default: RAY_ADDRESS, else a local cluster]."),
    ray_retries: int = typer.Option(2, "--ray-retries", help="Times a spec is resubmitted after its Ray worker dies."),
) -> None:
    """Time candidate designs of generated kernels on this GPU beside FlexAttention and SDPA; keep the fastest correct
    one as measured records and a performance lesson (one transaction). Without a GPU, --plan writes the work for one.
    With --backward the designs are the backward kernel's, and the records become its performance memory: later
    `kb generate` runs rank backward designs from them."""
    from generate.tune import make_plan, require_gpu

    if max_designs < 1:
        raise KBError("--max-designs must be at least 1")
    if plan is not None and use_ray:
        raise KBError("--plan writes the work down for a GPU machine and --ray runs it on a cluster's GPUs: give one")
    targets = _spec_targets(targets)
    kb = open_kb_of(ctx)
    if plan is not None:
        arch = target if target != "auto" else settings_of(ctx).target_arch
        _write_plan(make_plan(kb, targets, from_dir, arch, max_designs=max_designs, memory=not no_memory,
                              backward=backward), plan, then="kb perf import RESULTS.json",
                    runner="bench.gpu.tune_bwd" if backward else "bench.gpu.tune")
        return
    if ray_address is not None and not use_ray:
        raise KBError("--ray-address is for --ray campaigns; add --ray")
    if use_ray:
        arch = target if target != "auto" else settings_of(ctx).target_arch
        _tune_on_ray(kb, make_plan(kb, targets, from_dir, arch, max_designs=max_designs, memory=not no_memory,
                                   backward=backward), results or (kb.settings.home / "tune-last.json"),
                     "kb tune --ray " + ("--backward " if backward else "") + " ".join(targets), ray_address,
                     ray_retries, as_json)
        return
    arch = require_gpu()
    from generate.perf_import import import_results
    from bench.gpu.tune import time_plan

    doc_plan = make_plan(kb, targets, from_dir, arch, max_designs=max_designs, memory=not no_memory, backward=backward)
    raw = results or (kb.settings.home / "tune-last.json")
    command = "kb tune " + ("--backward " if backward else "") + " ".join(targets)
    with err.status(f"timing {sum(len(e['designs']) for e in doc_plan['entries'])} "
                    f"{'backward ' if backward else ''}designs on {esc(arch)} …"):
        doc = time_plan(doc_plan, raw, backward=backward, command=command)
    summary = import_results(kb, doc, str(raw))
    if as_json:
        out.print_json(json.dumps(doc))
        return
    out.print(results_table(doc))
    out.print(f"stored {summary.perf_records} measured records and {summary.lessons} lessons; raw results in {raw}", markup=False)


def _tune_on_ray(kb, plan: dict, raw: Path, command: str, address: str | None, retries: int,
                 as_json: bool) -> None:
    """`kb tune --ray`: one num_gpus=1 task per spec (generate.campaign); each spec's results document is kept beside
    `raw` (`raw` with `.N` before its suffix, one per spec) and imported as `kb perf import` would."""
    from bench.gpu.tune import time_plan
    from generate.campaign import run_tune_campaign
    from generate.perf_import import import_results

    if retries < 0:
        raise KBError("--ray-retries must be 0 or more")
    with err.status(f"timing {sum(len(e['designs']) for e in plan['entries'])} designs on the Ray cluster's GPUs …"):
        docs, failures, retried = run_tune_campaign(plan, timer=time_plan, address=address, command=command, retries=retries,
                                                    on_done=lambda spec, doc, why: err.print(
                                                        f"{spec}: {'timed' if doc is not None else 'failed: ' + why}",
                                                        markup=False))
    records = lessons = 0
    for n, doc in enumerate(docs):
        path = raw.with_name(f"{raw.stem}.{n}{raw.suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1))
        summary = import_results(kb, doc, str(path))
        records, lessons = records + summary.perf_records, lessons + summary.lessons
    if retried:
        err.print(f"{retried} task(s) resubmitted after their Ray worker died", markup=False)
    if as_json:
        out.print_json(json.dumps(docs))
    else:
        for doc in docs:
            out.print(results_table(doc))
        out.print(f"stored {records} measured records and {lessons} lessons from {len(docs)} spec(s); raw results in "
                  f"{raw.with_name(raw.stem + '.N' + raw.suffix)}", markup=False)
    if failures:
        raise KBError(f"{len(failures)} spec(s) were not timed: " + "; ".join(failures))


@app.command("bench")
def bench_cmd(
    ctx: typer.Context,
    suite: list[Path] = typer.Argument(..., help="Spec files or directories of specs (e.g. bench/heldout), timed at their BENCH shapes."),
    from_dir: Path = typer.Option(Path("out"), "--from", help="The --out directory `kb generate` wrote the candidates to."),
    out_dir: Path = typer.Option(Path("bench/results"), "--out", help="Where the results JSON goes."),
    plan: Path = typer.Option(None, "--plan", help="Write the work to this plan file instead of timing (no GPU needed)."),
) -> None:
    """Time what `kb generate` emitted (ModelNew as a user calls it; the module with its block table kept) beside
    compiled FlexAttention (block mask built once) and SDPA, on this GPU; every output checked against a dense
    fp32 reference first. Without a GPU, --plan writes the work for one (`python -m bench.gpu.tune`)."""
    from generate.tune import make_plan, require_gpu

    specs = _spec_targets([str(p) for p in suite])
    kb = open_kb_of(ctx)
    if plan is not None:
        _write_plan(make_plan(kb, specs, from_dir, settings_of(ctx).target_arch, max_designs=0), plan)
        return
    arch = require_gpu()
    from bench.gpu.tune import run_plan

    doc_plan = make_plan(kb, specs, from_dir, arch, max_designs=0)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench_{suite[0].stem}.json"
    with err.status(f"timing {len(doc_plan['entries'])} generated kernels on {esc(arch)} …"):
        doc = run_plan(doc_plan, path, command="kb bench " + " ".join(map(str, suite)))
    out.print(results_table(doc))
    out.print(f"results in {path}", markup=False)


@perf_app.command("import")
def perf_import_cmd(
    ctx: typer.Context,
    files: list[Path] = typer.Argument(..., help="Results files written by `python -m bench.gpu.tune`, `python -m bench.gpu.tune_bwd` (a `kb tune --backward` plan) or `kb tune --results`."),
) -> None:
    """Store measured designs from a GPU machine: kernels, `measured` perf records and lessons, one transaction per file.
    Files that do not say where they were measured (GPU, driver, versions, command, date) are refused."""
    from generate.perf_import import import_results, load_results

    kb = open_kb_of(ctx)
    for f in files:
        s = import_results(kb, load_results(f), str(f))
        out.print(f"{f}: {s.entries} entries, {s.kernels_added} new kernels, {s.perf_records} measured records, "
                  f"{s.lessons} lessons", markup=False)


def _spec_targets(targets: list[str]) -> list[str]:
    """Directories become the spec files in them (files starting with `_` are helpers, not specs)."""
    out_ = [str(p) for t in targets
            for p in (sorted(x for x in Path(t).glob("*.py") if not x.name.startswith("_")) if Path(t).is_dir() else [t])]
    if not out_:
        raise KBError(f"no spec files in {', '.join(targets)}")
    return out_


def _write_plan(doc: dict, path: Path, then: str = "", runner: str = "bench.gpu.tune") -> None:
    path.write_text(json.dumps(doc, indent=1))
    out.print(f"plan for {len(doc['entries'])} spec/shape entries written to {path}; on a GPU machine run\n"
              f"  python -m {runner} {path} RESULTS.json" + (f"\nthen here: {then}" if then else ""), markup=False)


def results_table(doc: dict) -> Table:
    """Per spec and shape: the emitted design, the best design, and both against FlexAttention and SDPA."""
    t = Table(title=esc(f"kb tune on {doc['env']['gpu']} ({doc['env']['arch']})"))
    for col in ("spec", "shape", "emitted (ms)", "best design (ms)", "emitted/best", "x flex", "x sdpa"):
        t.add_column(col)
    for e in doc["entries"]:
        for s in e.get("shapes", []):
            recs = {r["impl"]: r for r in s.get("records", [])}
            ok = [r for r in s.get("records", []) if r["impl"].startswith("design ") and r.get("status") == "ok"]
            best = min(ok, key=lambda r: r["ms"], default=None)
            em = recs.get("emitted", {}).get("ms", math.nan)
            dims = s.get("shape", {})

            def speed(impl: str, em: float = em) -> str:
                base = recs.get(impl, {}).get("ms")
                return f"{base / em:.2f}" if base and em == em else "-"

            t.add_row(esc(e["name"]), f"B{dims.get('B')} H{dims.get('Hq')}/{dims.get('Hkv')} {dims.get('M')}x{dims.get('N')} D{dims.get('D')}",
                      esc(f"{em:.3f} ({s.get('emitted_bwd_design') or s.get('emitted_design')})"), esc(f"{best['ms']:.3f} ({best['design']})") if best else "-",
                      f"{em / best['ms']:.2f}" if best else "-", speed("flex"), speed("sdpa"))
    return t
