"""Digests of this project's own code: what caches put in their keys so that a code change makes them miss."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["code_digest"]


def code_digest(roots: Sequence[Path]) -> str:
    """sha256 over every file under `roots` (path and bytes), compiled caches excepted."""
    h = hashlib.sha256()
    for root in roots:
        for f in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(f"{root.name}/{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()
