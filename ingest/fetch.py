"""Fetch pinned releases through pip's configured index, verify sha256, cache and unpack.

Cache layout under `settings.cache_dir` (env `KB_CACHE_DIR` overrides):

    downloads/<distribution>-<version>/<filename>   the archive, kept after its hash checked out
    src/<distribution>-<version>-<kind>/            the unpacked tree (see ingest.archive)

Invariants: an archive whose sha256 differs from the manifest never stays in the cache; no host
is hard-coded (pip reads its own index configuration); a flash-attn sdist is fetched without
building CUDA code (`FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE` from the manifest's `env`,
`--no-build-isolation` so pip's metadata step runs with the installed setuptools/torch).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from kb.errors import KBError
from kb.settings import Settings, load_settings
from ingest.archive import unpack
from ingest.manifest import Manifest
from ingest.model import FetchedSource, SourceKind

__all__ = ["fetch", "fetch_pypi", "fetch_local", "local_files", "LOCAL_SUFFIXES", "sha256_file", "pip_download"]

log = logging.getLogger(__name__)
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_download(requirement: str, kind: SourceKind, dest: Path, env: dict[str, str] | None = None,
                 *, show_progress: bool = False) -> Path:
    """Run `pip download` for one pinned requirement; returns the downloaded file, moved into `dest` whole (pip writes
    into a directory of its own here, so a process fetching the same release at once never reads half a file)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest) as tmp:
        got = _pip_download(requirement, kind, Path(tmp), env, show_progress)
        return got.replace(dest / got.name)


def _pip_download(requirement: str, kind: SourceKind, dest: Path, env: dict[str, str] | None,
                  show_progress: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--pre", "-d", str(dest), requirement,
           "--progress-bar", "on" if show_progress else "off"]
    if kind is SourceKind.SDIST:
        cmd += ["--no-binary=:all:", "--no-build-isolation"]
    else:
        cmd += ["--only-binary=:all:"]
    full_env = {**os.environ, **(env or {})}
    log.info("running %s", " ".join(cmd))
    # pip's progress and messages go to our stderr (fd 2): stdout keeps kb's results
    proc = subprocess.run(cmd, env=full_env, stdout=2 if show_progress else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("WARNING"))[-1500:]
        if "No matching distribution" in proc.stderr or "Could not find a version" in proc.stderr:
            raise KBError(f"pip found no {kind.value} for {requirement} on its configured index",
                          hint=f"check the name and version (`pip index versions --pre {requirement.split('==')[0]}`) "
                               f"and pip's index settings (`pip config list`); pip said: {tail.strip()[-400:]}")
        raise KBError(f"pip download {requirement} failed (exit {proc.returncode})", hint=tail.strip()[-800:])
    new = [p for p in dest.iterdir() if p.is_file()]
    if len(new) != 1:
        raise KBError(f"pip download {requirement} left {len(new)} files in {dest}; expected one archive")
    return new[0]


def _check_hash(path: Path, expected: str, what: str) -> str:
    actual = sha256_file(path)
    if expected and actual != expected:
        path.unlink(missing_ok=True)
        raise KBError(f"sha256 mismatch for {path.name} ({what}): expected {expected}, got {actual}; "
                      f"the cached file was removed",
                      hint="if the release was legitimately re-uploaded, update sha256 in its corpus manifest")
    return actual


def fetch(manifest: Manifest, settings: Settings | None = None, *, show_progress: bool | None = None) -> FetchedSource:
    """Download (once), verify and unpack the release pinned by `manifest`."""
    settings = settings or load_settings()
    if show_progress is None:
        show_progress = Console(stderr=True).is_terminal
    key = f"{manifest.distribution}-{manifest.version}"
    archive = settings.cache_dir / "downloads" / key / manifest.filename
    if not archive.is_file():
        got = pip_download(manifest.requirement, manifest.kind, archive.parent, dict(manifest.env),
                           show_progress=show_progress)
        if got.name != manifest.filename:
            got.unlink(missing_ok=True)
            raise KBError(f"pip downloaded {got.name} for {manifest.requirement}, manifest {manifest.name} "
                          f"expects {manifest.filename}", hint="fix filename/kind in the manifest")
    sha = _check_hash(archive, manifest.sha256, f"manifest {manifest.name}")
    # a wheel carries native libraries (vLLM's unpacks to 840 MB): only the listed files are unpacked
    wheel = manifest.kind is SourceKind.WHEEL
    root = unpack(archive, settings.cache_dir / "src" / f"{key}-{manifest.kind.value}", sha, show_progress=show_progress,
                  keep=manifest.lists if wheel else None, keep_key=" ".join(manifest.patterns()) if wheel else "")
    return FetchedSource(manifest.distribution, manifest.version, manifest.kind, manifest.filename, sha, root)


def fetch_pypi(distribution: str, version: str, kind: SourceKind = SourceKind.SDIST,
               settings: Settings | None = None, *, show_progress: bool | None = None) -> FetchedSource:
    """An unpinned-hash fetch for `kb ingest pypi:DIST==VER`; the sha256 is recorded, not checked."""
    settings = settings or load_settings()
    show_progress = Console(stderr=True).is_terminal if show_progress is None else show_progress
    key = f"{distribution}-{version}"
    folder = settings.cache_dir / "downloads" / key / kind.value
    existing = [p for p in folder.glob("*") if p.is_file()] if folder.is_dir() else []
    archive = existing[0] if len(existing) == 1 else None
    if archive is None:
        settings.cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=settings.cache_dir) as tmp:
            got = pip_download(f"{distribution}=={version}", kind, Path(tmp), show_progress=show_progress)
            folder.mkdir(parents=True, exist_ok=True)
            archive = got.rename(folder / got.name)
    sha = sha256_file(archive)
    root = unpack(archive, settings.cache_dir / "src" / f"{key}-{kind.value}", sha, show_progress=show_progress)
    return FetchedSource(distribution, version, kind, archive.name, sha, root)


LOCAL_SUFFIXES = frozenset({".py", ".h", ".cuh", ".cu", ".hpp", ".cpp", ".cc", ".cxx"})


def local_files(path: Path) -> list[Path]:
    """The files `kb ingest PATH` reads: PATH itself, or the kernel sources under it (hidden folders left out)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(path).parts))


def fetch_local(path: Path) -> FetchedSource:
    """A user's own kernels: a directory or one file, hashed by the content of the files read (no copy is made).

    `filename` is the resolved path, so each path and content is its own source row.
    """
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise KBError(f"{path} does not exist", hint="give a directory or a kernel source file")
    if path.is_file():
        return FetchedSource("local", "0", SourceKind.LOCAL, str(path), sha256_file(path), path.parent)
    h = hashlib.sha256()
    for f in local_files(path):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return FetchedSource("local", "0", SourceKind.LOCAL, str(path), h.hexdigest(), path)
