"""The per-spec files of `kb generate --out DIR`, written as one consistent set.

Attempts write their candidate into a private staging directory inside DIR (same file system,
so a move is a rename). Only when the run ends is the set published: the spec's previous files
are removed, the new ones moved in, and the report last, so a reader who finds a report finds
the files it describes. A failed run publishes only a report saying "failed" (and removes an
older run's candidate, which would otherwise sit beside it looking like a result). An
interrupted run publishes nothing: DIR keeps whatever the last finished run left. Staging
directories of processes that died (SIGKILL) are removed by the next run into the same DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from kb.errors import KBError

__all__ = ["SUFFIXES", "OutputError", "output_stem", "publish", "staging_dir", "write_error"]

# every file a run may write for spec stem S: S.py (ModelNew), S_triton.py, S.aux.pt, S.kbir, S_bwd.kbir (the
# backward program), S.cu, S.report.json
SUFFIXES = (".py", "_triton.py", ".aux.pt", ".kbir", "_bwd.kbir", ".cu", ".report.json")
_PREFIX = ".kb-staging-"


class OutputError(KBError):
    """A file of the run could not be written (a full disk, a read-only or removed directory): the run fails there."""


def write_error(where: Path, err: OSError) -> OutputError:
    """One line naming the file and the system's reason (`No space left on device`)."""
    return OutputError(f"cannot write {err.filename or where}: {err.strerror or err}")


def output_stem(spec_path: Path) -> str:
    """The program name and file stem of a spec's outputs: gen_<spec file stem>."""
    return "gen_" + "".join(c if c.isalnum() else "_" for c in spec_path.stem)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_stagings(out_dir: Path) -> None:
    for d in out_dir.glob(_PREFIX + "*"):
        pid = d.name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


@contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """A fresh private directory inside `out_dir`, removed on exit whatever happens."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        _remove_dead_stagings(out_dir)
        path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=out_dir))
    except OSError as err:
        raise KBError(f"cannot write to --out {out_dir}: {err.strerror or err}") from err
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def publish(out_dir: Path, stem: str, files: Mapping[str, Path], report: dict) -> dict[str, Path]:
    """Replace the spec's files in `out_dir` by `files` (staged paths, by kind) and `report`; the report goes last.

    Returns the published paths by kind, the report's under "report"."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise KBError(f"cannot write to --out {out_dir}: {err.strerror or err}") from err
    report_path = out_dir / f"{stem}.report.json"
    tmp = report_path.with_name(report_path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str))  # first: a full disk fails here
        report_path.unlink(missing_ok=True)  # from here on, no report describes stale files
        for suffix in SUFFIXES:
            (out_dir / f"{stem}{suffix}").unlink(missing_ok=True)
        published = {}
        for kind, staged in files.items():
            dest = out_dir / staged.name
            os.replace(staged, dest)  # a rename on one file system: needs no space
            published[kind] = dest
        os.replace(tmp, report_path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise write_error(out_dir, err) from None
    published["report"] = report_path
    return published
