"""The file-system view of a sandboxed child, as Landlock rules: read almost everything, write almost nothing.

`FsView.rules()` turns three lists of paths into (path, rights) pairs:
- `hidden` trees (the user's home, the KB home) are not readable at all: the rest of the file system is
  read-only, which Landlock (an allow-list) can only say by granting read on every *sibling* along the
  path from / to each hidden tree;
- `readable` paths inside hidden trees are readable again (the interpreter, the virtual environment and
  the project code often live in the home; the spec's and candidate's directories), less any hidden tree
  inside them (`make demo` keeps its KB home in the checkout);
- `writable` paths (the child's own directory, the sandbox's compiler caches) get every right;
- /proc is readable except the per-process directories: another process's `environ` would hand over the very
  secrets the environment scrub withholds (Landlock's ptrace rule does not cover reading it). The child's own
  /proc/PID is granted by verify.confine, which knows the pid;
- /dev is listable, and only the devices a kernel run needs can be opened (/dev/null, /dev/urandom, the GPU
  drivers' nodes); never a disk, /dev/mem or a new device file.
Symbolic links met on the walk are skipped: a path through one resolves to its target, which has its own rule.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from verify.landlock import FS, READ, WRITE

__all__ = ["FsView", "DEV_RIGHTS"]

log = logging.getLogger(__name__)

DEV_RIGHTS = READ | FS.WRITE_FILE | FS.TRUNCATE
DEVICES = ("null", "zero", "full", "random", "urandom")
GPU_DEVICES = ("nvidia", "kfd", "dri")  # name prefixes: /dev/nvidia*, /dev/nvidia-caps/, AMD's /dev/kfd and /dev/dri/
_PROC, _DEV = Path("/proc"), Path("/dev")


def _inside(path: Path, tree: Path) -> bool:
    return path == tree or tree in path.parents


@dataclass(frozen=True)
class FsView:
    hidden: tuple[Path, ...]
    readable: tuple[Path, ...]
    writable: tuple[Path, ...]

    def effective_hidden(self) -> tuple[Path, ...]:
        """The hidden trees that exist, less / and any tree inside a writable path (the child must write there)."""
        writable = [w.resolve() for w in self.writable]
        found = {h.resolve() for h in self.hidden}
        return tuple(sorted(h for h in found if h != Path("/") and h.is_dir() and not any(_inside(h, w) for w in writable)))

    def rules(self) -> list[tuple[Path, int]]:
        hidden = self.effective_hidden()
        rules: list[tuple[Path, int]] = []
        self._cover(Path("/"), (*hidden, _PROC, _DEV), rules)  # /proc and /dev get their own rules below
        rules += _proc_rules() + _dev_rules()
        for r in (p.resolve() for p in self.readable):  # a readable tree holding a hidden one is walked like /
            if r.exists():
                self._cover(r, (*hidden, _PROC, _DEV), rules)
        rules += [(w.resolve(), READ | WRITE) for w in self.writable if w.exists()]
        return rules

    def _cover(self, d: Path, hidden: tuple[Path, ...], rules: list[tuple[Path, int]]) -> None:
        """Read on everything under directory `d` except the hidden trees."""
        if d in hidden:
            return
        if not any(d in h.parents for h in hidden):
            rules.append((d, READ))
            return
        try:
            entries = list(os.scandir(d))
        except OSError as err:
            log.debug("sandbox view: cannot list %s (%s); left unreadable", d, err)
            return
        for e in entries:
            if e.is_symlink():
                continue
            p = Path(e.path)
            if e.is_dir(follow_symlinks=False):
                self._cover(p, hidden, rules)
            elif p not in hidden:
                rules.append((p, READ))


def _entries(d: Path) -> list[os.DirEntry[str]]:
    try:
        return [e for e in os.scandir(d) if not e.is_symlink()]
    except OSError:
        return []


def _proc_rules() -> list[tuple[Path, int]]:
    """/proc listable; its system-wide entries (cpuinfo, meminfo, sys, driver/nvidia) readable; no process's directory."""
    if not _PROC.is_dir():
        return []
    return [(_PROC, int(FS.READ_DIR))] + [(Path(e.path), READ) for e in _entries(_PROC) if not e.name.isdigit()]


def _dev_rules() -> list[tuple[Path, int]]:
    if not _DEV.is_dir():
        return []
    keep = [e for e in _entries(_DEV) if e.name in DEVICES or e.name.startswith(GPU_DEVICES)]
    return [(_DEV, int(FS.READ_DIR))] + [(Path(e.path), DEV_RIGHTS) for e in keep]
