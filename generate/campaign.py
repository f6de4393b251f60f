"""Campaigns on a Ray cluster: `kb generate --ray` runs each spec as a Ray task against the team's shared KB.

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
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
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

__all__ = ["run_campaign", "CampaignReport", "require_shared_kb", "RAY_MISSING"]

RAY_MISSING = "Ray is not installed: `pip install 'kernel-kb[ray]'` (or `pip install ray`) on the driver and every worker"
# variables a worker needs to be the driver's twin: the KB's settings, Triton's and the embedding model's caches
_ENV_PREFIXES = ("KB_", "TRITON_", "HF_", "TRANSFORMERS_", "SENTENCE_TRANSFORMERS_", "TORCHINDUCTOR_")
_WORKER_KBS: dict[Settings, KnowledgeBase] = {}  # per worker process: one open KB (and embedding model) for its tasks


@dataclass
class CampaignReport:
    """The results in spec order, and what the faults cost."""

    results: list[GenerateResult]
    retried: int = 0  # task attempts whose worker died and were submitted again
    workers: int = 0  # CPUs the cluster offered when the campaign started


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


def _failed(spec: Path, run_id: str, why: str) -> GenerateResult:
    return GenerateResult(spec, run_id, False, None, (), {}, why)


def _one_line(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err  # a RayTaskError carries the task's own exception
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}".rstrip(": ")


def run_campaign(kb: KnowledgeBase, specs: Sequence[Path], options: GenerateOptions, *, address: str | None = None,
                 force: bool = False, retries: int = 2,
                 on_done: Callable[[GenerateResult, int, int], None] | None = None) -> CampaignReport:
    """Generate `specs` as Ray tasks on the cluster at `address` (None: RAY_ADDRESS, else a local cluster started for
    the campaign); `on_done(result, finished, total)` as each spec finishes. Raises KeyboardInterrupt (with what was
    kept) on Ctrl-C, after cancelling the rest."""
    require_shared_kb(kb.settings)
    # Ray's driver prints what its workers report (a worker that died, ...) on stdout, which is the command's output
    # (a --json document): while Ray runs in this process, stdout is stderr
    with contextlib.redirect_stdout(sys.stderr):
        return _run(kb, specs, options, address, force, retries, on_done)


def _run(kb: KnowledgeBase, specs: Sequence[Path], options: GenerateOptions, address: str | None, force: bool,
         retries: int, on_done: Callable[[GenerateResult, int, int], None] | None) -> CampaignReport:
    try:
        import ray
        from ray import exceptions as rx
    except ImportError:
        raise KBError(RAY_MISSING) from None
    died = (rx.WorkerCrashedError, rx.NodeDiedError, rx.OutOfMemoryError, rx.LocalRayletDiedError, rx.ObjectLostError)
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    local = address is None and not os.environ.get("RAY_ADDRESS")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started and (why := _unreachable(address or os.environ.get("RAY_ADDRESS", ""))):
        raise KBError(f"cannot reach the Ray cluster at {address or os.environ.get('RAY_ADDRESS')}: {why}",
                      hint="start one with `ray start --head` (README: \"Campaigns on a Ray cluster\")")
    if started:
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING,
                     **({"include_dashboard": False} if local else {}))
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise KBError(f"cannot reach the Ray cluster at {address or os.environ.get('RAY_ADDRESS')}: "
                          f"{_one_line(err)}") from None
        finally:  # ray.init installs its own (exit at once): Ctrl-C and SIGTERM must reach the cancelling below
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
    task = ray.remote(num_cpus=1, max_retries=0)(_generate_task).options(runtime_env={"env_vars": env})
    cwd = os.getcwd()
    report = CampaignReport([_failed(p, "", "not run") for p in specs],
                            workers=int(ray.cluster_resources().get("CPU", 0)))
    pending: dict[Any, tuple[int, int, str]] = {}  # object ref -> (spec index, attempt, run id)

    def submit(i: int, attempt: int) -> None:
        rid = new_run_id()
        pending[task.remote(kb.settings, cwd, str(specs[i]), options, force, rid)] = (i, attempt, rid)

    finished = 0
    try:
        for i in range(len(specs)):
            submit(i, 0)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            i, attempt, rid = pending.pop(ref)
            try:
                result = ray.get(ref)
            except died as err:
                kb.interrupt_run(rid, f"interrupted: its Ray worker died ({type(err).__name__})")
                if attempt < retries:
                    report.retried += 1
                    submit(i, attempt + 1)
                    continue
                result = _failed(specs[i], rid, f"its Ray worker died {attempt + 1} time(s) ({type(err).__name__}); "
                                                f"run {rid} is marked interrupted")
            except rx.RayError as err:  # the task raised: a failure of this spec, not of the campaign
                why = _one_line(err)
                kb.interrupt_run(rid, f"interrupted: the task raised {why}")
                result = _failed(specs[i], rid, f"the Ray task raised {why}")
            report.results[i] = result
            finished += 1
            if on_done is not None:
                on_done(result, finished, len(specs))
    except KeyboardInterrupt as stop:
        for ref, (_, _, rid) in pending.items():
            ray.cancel(ref, force=True)
            kb.interrupt_run(rid, "interrupted: the campaign was cancelled (Ctrl-C or SIGTERM)")
        ray.wait(list(pending), num_returns=len(pending), timeout=10.0)  # the cancelled workers exit
        _clean_here()
        said = [str(stop)] if str(stop) else []
        raise KeyboardInterrupt("; ".join([*said, f"{finished} of {len(specs)} spec(s) finished and kept, "
                                           f"{len(pending)} cancelled (their runs marked interrupted)"])) from stop
    finally:
        if started:
            ray.shutdown()
    if report.retried:
        _clean_here()
    return report


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
