"""Where the data files kernel-kb ships are found: `corpus/` (pinned release manifests, measured designs).

`corpus/` is data, not code: a top-level directory of the repository without `__init__.py`. A checkout (an
editable install, `make demo`) reads it there, beside the packages; a wheel carries it as package data inside
`kb` (`kb/corpus/`, mapped by pyproject.toml's `[tool.setuptools.package-dir]`). Found in neither place, or
holding none of the files asked for, is an error naming where it looked: an installation without its data
must never look like an empty corpus.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kb.errors import KBError

__all__ = ["corpus_dir", "corpus_files"]

_REINSTALL = "reinstall kernel-kb (`pip install .` or `pip install -e .` from a checkout)"


def _kb_package() -> Path:
    root = resources.files("kb")
    if not isinstance(root, Path):  # a zipped install: the corpus must be readable as files
        raise KBError(f"kernel-kb's package kb is not a directory ({root}); {_REINSTALL}")
    return root


def _candidates() -> tuple[Path, Path]:
    """(the wheel's `kb/corpus`, the checkout's `corpus/` beside the packages)."""
    package = _kb_package()
    return package / "corpus", package.parent / "corpus"


def corpus_dir() -> Path:
    """The shipped `corpus/` directory: the wheel's package data, else the checkout's top-level directory."""
    installed, checkout = _candidates()
    if installed.is_dir():
        return installed
    # only a checkout's: a site-packages/corpus/ beside an installed kb would be another distribution's
    if checkout.is_dir() and (checkout.parent / "pyproject.toml").is_file():
        return checkout
    raise KBError(f"kernel-kb's data directory corpus/ is missing: not in {installed} (an installed wheel) "
                  f"nor in {checkout} (a checkout)", hint=_REINSTALL)


def corpus_files(pattern: str) -> list[Path]:
    """The shipped files matching `pattern` under `corpus/` (e.g. "*.toml", "measured/*.json"), sorted; none is an error."""
    root = corpus_dir()
    found = sorted(root.glob(pattern))
    if not found:
        raise KBError(f"kernel-kb's corpus {root} holds no {pattern} files", hint=_REINSTALL)
    return found
