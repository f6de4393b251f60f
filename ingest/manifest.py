"""Corpus manifests (`corpus/*.toml`): a pinned release and which of its files each lifter reads.

Format:

    distribution = "flash-attn"
    version = "2.8.3.post2"
    kind = "sdist"                     # or "wheel"
    filename = "flash_attn-2.8.3.post2.tar.gz"
    sha256 = "..."
    env = { FLASH_ATTENTION_SKIP_CUDA_BUILD = "TRUE" }   # optional, for pip's metadata step
    [[files]]
    path = "csrc/flash_attn/src/mask.h"  # glob relative to the unpacked root
    lifter = "cuda"                      # "cuda", "cute" or "triton"
    family = "fa2_cuda"
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kb.data_files import corpus_files
from kb.errors import KBError
from ingest.model import SourceKind

__all__ = ["FileRule", "Manifest", "LIFTERS", "expand_braces", "load_manifest", "list_manifests", "find_manifest"]

LIFTERS = ("cuda", "cute", "triton")


@dataclass(frozen=True)
class FileRule:
    path: str  # glob, relative to the unpacked root
    lifter: str  # one of LIFTERS
    family: str


@dataclass(frozen=True)
class Manifest:
    name: str  # the file stem, e.g. "flash-attn-2"
    distribution: str
    version: str
    kind: SourceKind
    filename: str
    sha256: str
    files: tuple[FileRule, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    def patterns(self) -> tuple[str, ...]:
        """Every file glob of the manifest, braces expanded."""
        return tuple(p for rule in self.files for p in expand_braces(rule.path))

    def lists(self, member: str) -> bool:
        """Whether an archive member path matches one of the manifest's globs."""
        return any(fnmatch.fnmatchcase(member, p) for p in self.patterns())


def expand_braces(pattern: str) -> list[str]:
    """`a/{x,y}.h` -> [`a/x.h`, `a/y.h`], nested and repeated groups included."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in expand_braces(pattern[: m.start()] + alt + pattern[m.end():])]


def load_manifest(path: Path) -> Manifest:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise KBError(f"cannot read corpus manifest {path}: {err}") from err
    missing = {"distribution", "version", "kind", "filename", "sha256", "files"} - set(data)
    if missing:
        raise KBError(f"corpus manifest {path} lacks {sorted(missing)}")
    try:
        kind = SourceKind(data["kind"])
    except ValueError:
        raise KBError(f"corpus manifest {path}: kind must be 'sdist' or 'wheel', not {data['kind']!r}") from None
    rules = []
    for i, entry in enumerate(data["files"]):
        if entry.get("lifter") not in LIFTERS or not entry.get("path") or not entry.get("family"):
            raise KBError(f"corpus manifest {path}: files[{i}] needs path, family and lifter in {LIFTERS}")
        rules.append(FileRule(entry["path"], entry["lifter"], entry["family"]))
    env = tuple(sorted((str(k), str(v)) for k, v in data.get("env", {}).items()))
    return Manifest(path.stem, data["distribution"], str(data["version"]), kind, data["filename"],
                    data["sha256"], tuple(rules), env)


def list_manifests(directory: Path | None = None) -> list[Manifest]:
    """The manifests in `directory`, by default the shipped corpus (`kb.data_files`: none there is an error)."""
    paths = sorted(directory.glob("*.toml")) if directory is not None else corpus_files("*.toml")
    return [load_manifest(p) for p in paths]


def find_manifest(name: str, directory: Path | None = None) -> Manifest:
    """A manifest by file stem or by distribution name."""
    manifests = list_manifests(directory)
    for m in manifests:
        if name in (m.name, m.distribution):
            return m
    known = ", ".join(m.name for m in manifests) or "none"
    raise KBError(f"no corpus manifest named {name!r}; known: {known}")
