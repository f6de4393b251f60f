"""The file-system view of a sandboxed child, as Landlock rules: read almost everything, write almost nothing.

`FsView.rules()` turns three lists of paths into (path, rights) pairs:
- `hidden` trees (the user's home, the KB home) are not readable at all: the rest of the file system is
  read-only, which Landlock (an allow-list) can only say by granting read on every *sibling* along the
  path from / to each hidden tree;
- `readable` paths inside hidden trees are readable again (the interpreter, the virtual environment and
  the project code often live in the home; the spec's and candidate's directories);
- `writable` paths (the child's own directory, the sandbox's compiler caches) get every right;
- /dev keeps reads and writes of existing device files (/dev/null, /dev/nvidia*), never new files.
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
        self._cover(Path("/"), hidden, rules)
        for r in (p.resolve() for p in self.readable):
            if not r.exists():
                continue
            if any(_inside(h, r) for h in hidden):  # granting it would uncover a hidden tree
                log.debug("sandbox view: %s holds a hidden tree; not made readable", r)
                continue
            rules.append((r, READ))
        rules += [(w.resolve(), READ | WRITE) for w in self.writable if w.exists()]
        if Path("/dev").is_dir():
            rules.append((Path("/dev"), DEV_RIGHTS))
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
