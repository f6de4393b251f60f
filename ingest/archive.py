"""Safe, idempotent unpacking of sdists (.tar.gz) and wheels (.zip).

Invariants: nothing is written outside `dest`; members with absolute paths, `..` components,
or links (symlinks/hardlinks) are rejected before anything is extracted; a finished unpack is
marked with a stamp holding the archive's sha256, so unpacking the same archive again is a no-op
and a changed archive replaces the tree. A `keep` filter (a wheel holds native libraries the lifters
never read) unpacks only the members it accepts; its `key` is part of the stamp, so a changed
filter unpacks again.
"""

from __future__ import annotations

import logging
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from rich.console import Console
from rich.progress import Progress

from kb.errors import KBError

__all__ = ["unpack", "STAMP"]

log = logging.getLogger(__name__)
STAMP = ".kb-unpacked"


def _check_member(archive: Path, name: str) -> None:
    p = PurePosixPath(name.replace("\\", "/"))
    if p.is_absolute() or name.startswith(("/", "\\")) or (p.parts and ":" in p.parts[0]) or ".." in p.parts:
        raise KBError(f"refusing to unpack {archive.name}: member {name!r} escapes the target directory",
                      hint="the archive is malformed or malicious; delete it from the cache")


def _tar_members(archive: Path, tf: tarfile.TarFile) -> list[tarfile.TarInfo]:
    members = tf.getmembers()
    for m in members:
        _check_member(archive, m.name)
        if m.issym() or m.islnk():
            raise KBError(f"refusing to unpack {archive.name}: member {m.name!r} is a link to {m.linkname!r}",
                          hint="expert releases contain no links; delete the archive from the cache")
        if not (m.isfile() or m.isdir()):
            raise KBError(f"refusing to unpack {archive.name}: member {m.name!r} is a special file")
    return members


Keep = Callable[[str], bool]


def unpack(archive: Path, dest: Path, sha256: str, *, show_progress: bool = False,
           keep: Keep | None = None, keep_key: str = "") -> Path:
    """Unpack `archive` (the members `keep` accepts, all by default) into `dest`; returns `dest`.

    Idempotent per (sha256, keep_key). Each call unpacks into a directory of its own and renames it into place whole,
    so processes unpacking the same archive at once never see (or delete) each other's half-written trees; the first
    to finish wins and the others discard their copies."""
    stamp = dest / STAMP
    mark = f"{sha256} {keep_key}".strip()
    if _stamped(stamp, mark):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{dest.name}.partial-", dir=dest.parent))
    try:
        _extract(archive, tmp, show_progress, keep or (lambda name: True))
        (tmp / STAMP).write_text(mark + "\n")
        if not _stamped(stamp, mark):
            if dest.exists():
                shutil.rmtree(dest)  # unpacked from another archive or with other members kept
            tmp.rename(dest)
            log.info("unpacked %s into %s", archive.name, dest)
    except OSError:
        if not _stamped(stamp, mark):  # not another process's rename winning the race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _stamped(stamp: Path, mark: str) -> bool:
    try:
        return stamp.read_text().strip() == mark
    except OSError:
        return False


def _extract(archive: Path, dest: Path, show_progress: bool, keep: Keep) -> None:
    name = archive.name
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        try:
            with tarfile.open(archive) as tf:
                members = [m for m in _tar_members(archive, tf) if m.isdir() or keep(m.name)]
                with Progress(disable=not show_progress, transient=True, console=Console(stderr=True)) as progress:
                    task = progress.add_task(f"unpack {name}", total=len(members))
                    for m in members:
                        tf.extract(m, dest, filter="data")
                        progress.advance(task)
        except (tarfile.TarError, EOFError, OSError) as err:
            raise KBError(f"cannot unpack {archive}: {err}", hint="delete it from the cache and fetch again") from err
    elif name.endswith((".whl", ".zip")):
        try:
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    _check_member(archive, info.filename)
                    if (info.external_attr >> 16) & 0o170000 == 0o120000:
                        raise KBError(f"refusing to unpack {name}: member {info.filename!r} is a symlink")
                infos = [i for i in zf.infolist() if keep(i.filename)]
                with Progress(disable=not show_progress, transient=True, console=Console(stderr=True)) as progress:
                    task = progress.add_task(f"unpack {name}", total=len(infos))
                    for info in infos:
                        zf.extract(info, dest)
                        progress.advance(task)
        except (zipfile.BadZipFile, OSError) as err:
            raise KBError(f"cannot unpack {archive}: {err}", hint="delete it from the cache and fetch again") from err
    else:
        raise KBError(f"do not know how to unpack {name}; expected .tar.gz or .whl")
