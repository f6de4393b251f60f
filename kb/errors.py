"""The one error type users can cause.

Anything a user can trigger (bad input file, unknown id, unreachable service)
raises `KBError` with a message that says what to do; the CLI prints it on one
line and exits non-zero. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["KBError"]


class KBError(Exception):
    """A user-facing error; `str(err)` is the whole message."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.hint = hint
        super().__init__(message if hint is None else f"{message} ({hint})")
