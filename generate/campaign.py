"""Campaigns on a Ray cluster: `kb generate --ray` runs each spec as a Ray task against the team's shared KB, and
`kb tune --ray` times each spec's designs as a task with a GPU of its own.

What runs where: the `kb` process is the driver; it submits one task per spec (`num_cpus=1`) and collects the
results as they finish. A task opens the KB from the driver's settings (PostgreSQL and a Chroma server, which every
worker must reach; an embedded SQLite/Chroma KB is refused, as several processes would write one directory) and
runs what a local `kb generate` runs for that spec, `generate_cached`, writing the spec's files under --out. So the
workers read the spec files and write the outputs at the driver's paths, from the driver's working directory: on one
host nothing is needed; across hosts, mount those directories at the same paths. The driver's `KB_*` variables and
Triton and Hugging Face cache settings travel with each task (`runtime_env`), so a worker uses the same KB, caches
and embedding model files.

The KB is the campaign's memory: lessons and kernels a task writes back are retrieved by tasks that start later.

Faults, decided by the driver (Ray's own task retries are off, so the driver knows each attempt's run): each task
attempt's run id is named by the driver. A task whose worker died (killed, out of memory, its node lost) has that run
marked `interrupted` and is submitted again under a new run id, at most `retries` times; a task that raised has its
run marked with the error and the spec counts as failed, and the campaign goes on. Anything committed before a
worker died stays (a kernel is keyed by its content: a retry that writes it again writes the same row, and the
generate cache serves a spec whose kernel was stored). Ctrl-C cancels the tasks still queued or running, marks their
runs interrupted and says how many specs finished.

Tuning: the driver makes the plan (as `kb tune --plan` does, no GPU needed there) and submits one `num_gpus=1` task
per spec, which runs the same timing code as a local `kb tune` on the GPU Ray assigned it and returns its results
document, with that GPU's environment; the driver imports each document as `kb perf import` would. A cluster
without GPUs is refused. Retries and Ctrl-C as for generation (a timing task writes nothing to the KB).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from generate.cache import generate_cached
from generate.pipeline import GenerateOptions, GenerateResult
from kb.errors import KBError
from kb.settings import Settings
from kb.store import KnowledgeBase, open_kb
from kb.store.doctor import remove_orphan_temp_dirs
from kb.store.ids import run_id as new_run_id

__all__ = ["run_campaign", "run_tune_campaign", "ray_session", "CampaignReport", "require_shared_kb", "RAY_MISSING"]

RAY_MISSING = "Ray is not installed: `pip install 'kernel-kb[ray]'` (or `pip install ray`) on the driver and every worker"
# variables a worker needs to be the driver's twin: the KB's settings, Triton's and the embedding model's caches
_ENV_PREFIXES = ("KB_", "TRITON_", "HF_", "TRANSFORMERS_", "SENTENCE_TRANSFORMERS_", "TORCHINDUCTOR_")
_WORKER_KBS: dict[Settings, KnowledgeBase] = {}  # per worker process: one open KB (and embedding model) for its tasks


@dataclass
class CampaignReport:
    """The results in spec order, and what the faults cost."""

    results: list[GenerateResult]
    retried: int = 0  # task attempts whose worker died and were submitted again


def require_shared_kb(settings: Settings) -> None:
    """KBError unless the KB is one every worker can write: a PostgreSQL database and a Chroma server."""
    if not settings.db_url.startswith("postgresql") or not settings.chroma_url:
        raise KBError("--ray needs the team's shared KB, which every worker writes: set KB_DB_URL to a PostgreSQL URL "
                      "and KB_CHROMA_URL to a Chroma server (an embedded SQLite/Chroma KB is one process's)",
                      hint="README: \"Campaigns on a Ray cluster\"")


def _generate_task(settings: Settings, cwd: str, spec: str, options: GenerateOptions, force: bool,
                   run_id: str) -> GenerateResult:
    """One spec on a Ray worker: what `kb generate SPEC` does locally, under the driver-named run id. A worker that
    died left its verify temp directory on its host: removed here when the retry lands on the same host (elsewhere
    `kb doctor --fix` on that host removes it)."""
    os.chdir(cwd)
    _clean_here()
    kb = _WORKER_KBS.get(settings)
    if kb is None:
        kb = _WORKER_KBS[settings] = open_kb(settings)
    return generate_cached(kb, Path(spec), options, force=force, run_id=run_id)


def _task_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}


def _failed(spec: Path, run_id: str, why: str) -> GenerateResult:
    return GenerateResult(spec, run_id, False, None, (), {}, why)


def _one_line(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err  # a RayTaskError carries the task's own exception
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}".rstrip(": ")


@dataclass
class _Job:
    """One spec's task: which spec, for messages, and its attempts."""

    index: int
    label: str  # its spec, for messages
    attempt: int = 0
    run_id: str = ""  # generate: the run id this attempt records under


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[Any]:
    """Ray connected (or a local cluster started) for one campaign; yields the `ray` module. While Ray runs in this
    process stdout is stderr: Ray's driver prints what its workers report (a worker that died, ...) on stdout, which
    is the command's output (a --json document)."""
    try:
        import ray  # noqa: PLC0415  optional (the ray extra): a missing Ray is the KBError below
    except ImportError:
        raise KBError(RAY_MISSING) from None
    given = address or os.environ.get("RAY_ADDRESS", "")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with contextlib.redirect_stdout(sys.stderr):
        if ray.is_initialized():  # a caller's own session (Python API)
            yield ray
            return
        if why := _unreachable(given):
            raise KBError(f"cannot reach the Ray cluster at {given}: {why}",
                          hint="start one with `ray start --head` (README: \"Campaigns on a Ray cluster\")")
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING,
                     include_dashboard=None if given else False)  # None: Ray's default
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise KBError(f"cannot reach the Ray cluster at {given}: {_one_line(err)}") from None
        finally:  # ray.init installs its own (exit at once): Ctrl-C and SIGTERM must reach the cancelling in _drive
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        try:
            yield ray
        finally:
            ray.shutdown()


def _drive(ray: Any, jobs: list[_Job], submit: Callable[[_Job], Any], retries: int,
           finish: Callable[[_Job, Any, str], None], lost: Callable[[_Job, str], object]) -> int:
    """Run `jobs` (`submit(job)` -> an object ref) to the end: `finish(job, value, why)` once per job (value None and
    `why` set when it failed), `lost(job, why)` for each attempt that did not finish (its worker died, it raised, it
    was cancelled). A job whose worker died is submitted again, `retries` times at most. Returns the resubmissions;
    KeyboardInterrupt (saying what was kept) after cancelling the rest."""
    from ray import exceptions as rx  # noqa: PLC0415  optional (the ray extra): only a Ray campaign gets here

    died = (rx.WorkerCrashedError, rx.NodeDiedError, rx.OutOfMemoryError, rx.LocalRayletDiedError, rx.ObjectLostError)
    pending = {submit(job): job for job in jobs}
    finished = retried = 0
    try:
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            job = pending.pop(ref)
            try:
                value, why = ray.get(ref), ""
            except died as err:
                lost(job, f"interrupted: its Ray worker died ({type(err).__name__})")
                if job.attempt < retries:
                    job.attempt += 1
                    retried += 1
                    pending[submit(job)] = job
                    continue
                value, why = None, f"its Ray worker died {job.attempt + 1} time(s) ({type(err).__name__})"
            except rx.RayError as err:  # the task raised: a failure of this job, not of the campaign
                lost(job, f"interrupted: the task raised {_one_line(err)}")
                value, why = None, f"the Ray task raised {_one_line(err)}"
            finished += 1
            finish(job, value, why)
    except KeyboardInterrupt as stop:
        for ref, job in pending.items():
            ray.cancel(ref, force=True)
            lost(job, "interrupted: the campaign was cancelled (Ctrl-C or SIGTERM)")
        ray.wait(list(pending), num_returns=len(pending), timeout=10.0)  # the cancelled workers exit
        _clean_here()
        said = [str(stop)] if str(stop) else []
        raise KeyboardInterrupt("; ".join([*said, f"{finished} of {len(jobs)} finished and kept, {len(pending)} "
                                           "cancelled"])) from stop
    if retried:
        _clean_here()
    return retried


def run_campaign(kb: KnowledgeBase, specs: Sequence[Path], options: GenerateOptions, *, address: str | None = None,
                 force: bool = False, retries: int = 2,
                 on_done: Callable[[GenerateResult, int, int], None] | None = None) -> CampaignReport:
    """Generate `specs` as Ray tasks on the cluster at `address` (None: RAY_ADDRESS, else a local cluster started for
    the campaign); `on_done(result, finished, total)` as each spec finishes. Raises KeyboardInterrupt (with what was
    kept) on Ctrl-C, after cancelling the rest."""
    require_shared_kb(kb.settings)
    env = _task_env()
    cwd = os.getcwd()
    report = CampaignReport([_failed(p, "", "not run") for p in specs])
    with ray_session(address) as ray:
        task = ray.remote(num_cpus=1, max_retries=0)(_generate_task).options(runtime_env={"env_vars": env})

        def submit(job: _Job) -> Any:
            job.run_id = new_run_id()
            return task.remote(kb.settings, cwd, str(specs[job.index]), options, force, job.run_id)

        done: list[int] = []

        def finish(job: _Job, result: GenerateResult | None, why: str) -> None:
            report.results[job.index] = result if result is not None else _failed(
                specs[job.index], job.run_id, f"{why}; run {job.run_id} is marked interrupted")
            done.append(job.index)
            if on_done is not None:
                on_done(report.results[job.index], len(done), len(specs))

        jobs = [_Job(i, str(p)) for i, p in enumerate(specs)]
        report.retried = _drive(ray, jobs, submit, retries, finish, lambda job, why: kb.interrupt_run(job.run_id, why))
    return report


def _tune_task(timer: Callable[..., dict], cwd: str, plan: dict, backward: bool, command: str, device: str) -> dict:
    """One spec's designs timed on the GPU Ray gave this task (CUDA_VISIBLE_DEVICES), from the driver's working
    directory (the plan's spec and candidate paths are the driver's): its results document."""
    os.chdir(cwd)
    with tempfile.TemporaryDirectory(prefix="kb-tune-") as tmp:
        return timer(plan, Path(tmp) / "results.json", backward=backward, command=command, device=device)


def run_tune_campaign(plan: dict, *, timer: Callable[..., dict], address: str | None = None, command: str = "",
                      retries: int = 2, device: str = "cuda",
                      on_done: Callable[[str, dict | None, str], None] | None = None,
                      ) -> tuple[list[dict], list[str], int]:
    """`plan`'s entries timed as Ray tasks, one per spec (`num_gpus=1`: Ray gives each its own GPU); (the results
    documents, each with the environment of the GPU it ran on, in the plan's order; one line per spec whose task
    failed; resubmissions after a worker died). `timer(plan, out_path, *, backward, command, device)`: the GPU timer
    each task runs (bench.gpu.tune.time_plan; the harness sits above this package). `device="cpu"`: the CPU dry run
    of the timing code (tests)."""
    groups: dict[str, list[dict]] = {}
    for entry in plan["entries"]:
        groups.setdefault(entry["spec"], []).append(entry)
    parts = [{**plan, "entries": entries} for entries in groups.values()]
    docs: list[dict | None] = [None] * len(parts)
    failures: list[str] = []
    env = _task_env()
    with ray_session(address) as ray:
        if device == "cuda" and ray.cluster_resources().get("GPU", 0) < 1:
            raise KBError("the Ray cluster offers no GPU (`ray status`); kb tune --ray runs one num_gpus=1 task per "
                          "spec: start the workers on GPU hosts (`ray start --num-gpus N`)")
        task = ray.remote(num_gpus=1, max_retries=0)(_tune_task).options(runtime_env={"env_vars": env})

        def finish(job: _Job, doc: dict | None, why: str) -> None:
            docs[job.index] = doc
            if doc is None:
                failures.append(f"{job.label}: {why}")
            if on_done is not None:
                on_done(job.label, doc, why)

        jobs = [_Job(i, spec) for i, spec in enumerate(groups)]
        cwd = os.getcwd()
        retried = _drive(ray, jobs, lambda job: task.remote(timer, cwd, parts[job.index], bool(plan.get("backward")),
                                                            command, device), retries, finish, lambda job, why: None)
    return [d for d in docs if d is not None], failures, retried


def _unreachable(address: str) -> str:
    """Why the GCS at a `host:port` address does not answer a TCP connect within 5 s ('' when it does, or when the
    address is another form: `auto`, `ray://`, empty), so a wrong address fails at once, not after Ray's minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return ""
    try:
        socket.create_connection((host, int(port)), timeout=5.0).close()
    except OSError as err:
        return err.strerror or str(err) or type(err).__name__
    return ""


def _clean_here() -> None:
    """Remove the verify temp directories that killed or cancelled workers left on this host (others: `kb doctor
    --fix` there)."""
    remove_orphan_temp_dirs(Path(tempfile.gettempdir()))
