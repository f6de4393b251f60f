"""The cache of `kb generate`: an unchanged spec against an unchanged KB gets its stored kernel back in seconds.

**The key** is a sha256 over (all readable in the entry's `entry.json`):
- the spec: the sha256 of its text (`Spec.source_hash`, read without importing or tracing the file, which is
  the slow part) and its output stem `gen_<file stem>` (the stem names the generated program and its files).
  Only the spec file itself is hashed, not modules it imports;
- the target arch (`--target`, resolved: auto is this machine's GPU, else `KB_TARGET_ARCH`);
- the code version: kernel-kb's version, a digest of every file of the packages that decide the output
  (kb, ingest, retrieve, verify, generate), and the installed torch and triton versions, so that a code
  change never serves a kernel the new code would not write;
- every option that changes what is written: engine (and the LLM model), memory, backward, verify on/off and
  the harness's distributions and case count, nvcc on the `.cu`, designs or CUDA plan given by a caller.
  Not the search budget (attempts, `--timeout`, references): it bounds how long the search may take, and a
  kernel that passed within any budget is the answer;
- the KB's expert and performance knowledge: the ids of its ingested programs, tunables and measured perf
  records (what retrieval and the emitted design tables are built from). After `kb ingest` of a new release,
  `kb tune` or `kb perf import`, the next `kb generate` regenerates, so the module carries the new designs.
  What generation itself writes back (generated kernels, runs, attempts, lessons) is not in the key: it only
  helps to find a kernel, and every run writes some, so the cache would never hit.

**A hit** is served only while the KB still vouches for it: the entry's forward kernel (and its backward
kernel, if the entry has one) must still be in the KB, and verified when the report says `verified` (`kb doctor
--fix` marks a kernel whose IR no longer matches its hash unverified), and every file must still have the
sha256 recorded when it was stored. Otherwise the entry is removed and the spec regenerated.

**Where entries live**: `$KB_HOME/generated/specs/<key>/`, local to the machine, holding the whole published
set of the run (`gen_<stem>.py`, `_triton.py`, `.aux.pt`, `.kbir`, `_bwd.kbir`, `.cu`, `.report.json`) and
`entry.json`. Not in the KB: the rows hold the Triton module but not the ModelNew candidate, the `.aux.pt`
state (binary, the spec Model's initial values) or the report, and putting them there would change the schema,
export, import and doctor for what is a cache: it can be lost at any time and rebuilt by one more generation.
A team sharing a PostgreSQL KB still shares the part that matters: on another machine the first `kb generate`
of a spec finds its kernel by retrieval (`kernel_was_in_kb`) and caches the files locally. An entry is written
in a staging directory and renamed into place, so a reader sees a whole entry or none.

**On a hit** `kb generate` restores the set into `--out` through `generate.outputs.publish` (one consistent set,
the report last), with the report as the generating run wrote it plus `"cached": {"run_id", "key", "stored_at"}`
and `spec` set to the path given now. It runs no attempt and records no run: nothing was generated or learnt,
and `generation_runs` keeps counting generations (its success rates and attempts-to-success stay those of real
work); the report names the run that made the files. `--force` skips the lookup, regenerates, and replaces the
entry when the run succeeds. A failed run is never cached, and does not remove an entry (with `--force`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from sqlmodel import select

from generate.outputs import output_stem, publish, staging_dir
from generate.pipeline import FromCache, GenerateOptions, GenerateResult, generate, resolve_target
from generate.spec import spec_source_hash
from generate.stages import ReportStatus
from kb import __version__
from kb.digests import code_digest
from kb.settings import Settings
from kb.store.kb import KnowledgeBase
from kb.store.models import Kernel, Origin, PerfKind, PerfRecord, Tunable

__all__ = ["CacheKey", "Entry", "cache_key", "cached_run", "code_digest", "code_version", "generate_cached",
           "knowledge_digest", "lookup", "specs_dir", "kernels_dir", "store"]

log = logging.getLogger(__name__)

FORMAT = "1"  # the entry layout; a change makes every older entry miss
MANIFEST = "entry.json"
CODE_PACKAGES = ("kb", "ingest", "retrieve", "verify", "generate")  # their files decide what generation writes


def specs_dir(settings: Settings) -> Path:
    """Where cache entries of specs live: one directory per key."""
    return settings.home / "generated" / "specs"


def kernels_dir(settings: Settings) -> Path:
    """Where kernel modules loaded by id (generate.load) are written, named by content."""
    return settings.home / "generated" / "kernels"


# ---------------------------------------------------------------- the key


@dataclass(frozen=True)
class CacheKey:
    digest: str  # sha256 hex of `parts`
    parts: Mapping[str, str]  # what went into it, by name


@functools.cache
def code_version() -> str:
    """kernel-kb's version and a digest of the code that decides the output, e.g. `0.1.0+3f2a…`."""
    roots = []
    for name in CODE_PACKAGES:
        found = importlib.util.find_spec(name)
        assert found is not None and found.submodule_search_locations, f"package {name} is importable"
        roots.append(Path(list(found.submodule_search_locations)[0]))
    return f"{__version__}+{code_digest(roots)[:16]}"


def knowledge_digest(kb: KnowledgeBase) -> str:
    """sha256 of the ids of the KB's ingested programs, tunables and measured perf records (ids are content hashes)."""
    with kb.read_session() as s:
        ids = [*s.exec(select(Kernel.id).where(Kernel.origin == Origin.INGEST.value)),
               *s.exec(select(Tunable.id)),
               *s.exec(select(PerfRecord.id).where(PerfRecord.kind == PerfKind.MEASURED.value))]
    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _options(options: GenerateOptions) -> str:
    chosen = {"engine": options.engine, "memory": options.memory, "backward": options.backward,
              "deterministic": options.deterministic,
              "verify": options.verify_kernel, "verify_distributions": list(options.verify_distributions),
              "verify_max_cases": options.verify_max_cases, "compile_cuda": options.compile_cuda,
              "designs": None if options.designs is None else repr(options.designs),
              "cuda": None if options.cuda is None else repr(options.cuda)}
    return json.dumps(chosen, sort_keys=True)


def cache_key(kb: KnowledgeBase, spec_path: Path, options: GenerateOptions) -> CacheKey:
    """The key of `spec_path` generated with `options` against `kb` (see the module docstring)."""
    parts = {"format": FORMAT, "spec": spec_source_hash(spec_path), "stem": output_stem(spec_path),
             "target": resolve_target(options.target, kb.settings.target_arch), "code": code_version(),
             "torch": _version("torch"), "triton": _version("triton"), "options": _options(options),
             "knowledge": knowledge_digest(kb)}
    if options.engine == "llm":
        parts["llm_model"] = kb.settings.llm_model
    return CacheKey(hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest(), parts)


# ---------------------------------------------------------------- entries


@dataclass(frozen=True)
class Entry:
    """A cached published set: `path/<file>` by kind (as GenerateResult.files, the report under "report")."""

    path: Path
    key: str
    stem: str
    run_id: str
    kernel_id: str
    files: Mapping[str, str]  # kind -> file name in `path`
    sha256: Mapping[str, str]  # file name -> sha256 hex
    stored_at: str

    def file(self, kind: str) -> Path:
        return self.path / self.files[kind]

    @property
    def report(self) -> dict:
        return json.loads(self.file("report").read_text())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_entry(path: Path) -> Entry:
    m = json.loads((path / MANIFEST).read_text())
    return Entry(path, m["key"], m["stem"], m["run_id"], m["kernel_id"], m["files"], m["sha256"], m["stored_at"])


def _kernel_ids(report: Mapping) -> list[tuple[str, bool]]:
    """(kernel id, must it be verified) of the forward kernel and, if there is one, the backward kernel."""
    ids = [(report["kernel_id"], report["status"] == ReportStatus.VERIFIED.value)]
    back = report.get("backward", {})
    if back.get("kernel_id"):
        ids.append((back["kernel_id"], back.get("status") == ReportStatus.VERIFIED.value))
    return ids


def _stale(kb: KnowledgeBase, entry: Entry, key: CacheKey) -> str:
    """Why `entry` must not be served for `key`, or ''."""
    if entry.key != key.digest:
        return f"entry holds key {entry.key[:12]}"
    for name, digest in entry.sha256.items():
        if not (entry.path / name).is_file() or _sha256(entry.path / name) != digest:
            return f"{name} is missing or changed since it was cached"
    for kid, verified in _kernel_ids(entry.report):
        row = kb.find(kid)
        if not isinstance(row, Kernel):
            return f"kernel {kid} is no longer in the KB"
        if verified and not row.verified:
            return f"kernel {kid} is no longer verified in the KB"
    return ""


def lookup(kb: KnowledgeBase, key: CacheKey) -> Entry | None:
    """The entry of `key` if the KB still vouches for it; a stale or broken entry is removed."""
    path = specs_dir(kb.settings) / key.digest
    if not (path / MANIFEST).is_file():
        log.info("generate cache: no entry for key %s", key.digest[:12])
        return None
    try:
        entry = _read_entry(path)
        why = _stale(kb, entry, key)
    except (OSError, ValueError, KeyError, TypeError) as err:
        why = f"unreadable entry ({type(err).__name__}: {err})"
    if why:
        log.info("generate cache: dropping entry %s: %s", key.digest[:12], why)
        shutil.rmtree(path, ignore_errors=True)
        return None
    log.info("generate cache: hit %s (run %s)", key.digest[:12], entry.run_id)
    return entry


def store(kb: KnowledgeBase, key: CacheKey, result: GenerateResult) -> Entry:
    """Cache the published files of a succeeded run under `key`, replacing an older entry."""
    assert result.succeeded and result.kernel_id, "only a succeeded run is cached"
    root = specs_dir(kb.settings)
    stem = output_stem(result.spec_path)
    with staging_dir(root) as stage:
        new = stage / "entry"
        new.mkdir()
        files = {}
        for kind, path in result.files.items():
            shutil.copy2(path, new / path.name)
            files[kind] = path.name
        manifest = {"format": FORMAT, "key": key.digest, "parts": dict(key.parts), "stem": stem, "run_id": result.run_id,
                    "kernel_id": result.kernel_id, "files": files,
                    "sha256": {name: _sha256(new / name) for name in files.values()},
                    "stored_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (new / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        _install(new, root / key.digest, stage)
    log.info("generate cache: stored run %s under key %s", result.run_id, key.digest[:12])
    return _read_entry(root / key.digest)


def _install(new: Path, final: Path, stage: Path) -> None:
    """Rename `new` to `final`; an older entry there moves into `stage` (removed with it) first."""
    try:
        os.rename(final, stage / "old")
    except FileNotFoundError:
        pass
    try:
        os.rename(new, final)
    except OSError:  # a concurrent run of the same key installed its entry in between: as good as ours
        log.info("generate cache: %s was installed by another process", final.name[:12])


def _restore(entry: Entry, spec_path: Path, out_dir: Path, t0: float) -> GenerateResult:
    """Publish the entry's files into `out_dir` as one set, the report saying where they came from."""
    report = {**entry.report, "spec": str(spec_path),
              "cached": {"run_id": entry.run_id, "key": entry.key, "stored_at": entry.stored_at}}
    with staging_dir(out_dir) as stage:
        files = {kind: Path(shutil.copy2(entry.path / name, stage / name))
                 for kind, name in entry.files.items() if kind != "report"}
        published = publish(out_dir, entry.stem, files, report)
    back = report.get("backward", {})
    return GenerateResult(spec_path, entry.run_id, True, entry.kernel_id, (), published, "", time.perf_counter() - t0,
                          ReportStatus(report["status"]), ReportStatus(back.get("status", ReportStatus.NONE.value)),
                          back.get("reason", ""), FromCache(entry.run_id, entry.key))


# ---------------------------------------------------------------- generate, through the cache


def cached_run(kb: KnowledgeBase, spec_path: Path, options: GenerateOptions = GenerateOptions(), *,
               force: bool = False, run_id: str = "") -> tuple[GenerateResult, Entry | None]:
    """`generate`, served from the cache when it can be; (the result, the entry now holding its files or None)."""
    t0 = time.perf_counter()
    spec_path = Path(spec_path)
    if not spec_path.is_file():  # generate records the refusal
        return generate(kb, spec_path, options, run_id=run_id), None
    key = cache_key(kb, spec_path, options)
    if not force and (entry := lookup(kb, key)) is not None:
        try:
            return _restore(entry, spec_path, options.out_dir or (Path.cwd() / "out"), t0), entry
        except FileNotFoundError as err:  # removed by a concurrent --force between lookup and copy
            log.warning("generate cache: entry %s vanished while restoring (%s); generating", key.digest[:12], err)
    result = generate(kb, spec_path, options, run_id=run_id)
    if not result.succeeded:
        return result, None
    return result, store(kb, key, result)


def generate_cached(kb: KnowledgeBase, spec_path: Path, options: GenerateOptions = GenerateOptions(), *,
                    force: bool = False, run_id: str = "") -> GenerateResult:
    """`generate(kb, spec_path, options)` through the cache (`force`: regenerate and refresh the entry; `run_id`: as
    for generate)."""
    return cached_run(kb, spec_path, options, force=force, run_id=run_id)[0]
