"""The code one part of a split loop runs: a generated module's loop-body helper with its IS_FULL branches resolved."""

from __future__ import annotations

__all__ = ["helper_source", "part_code"]

_HEADERS = ("    if IS_FULL:", "    if not IS_FULL:", "    else:")


def helper_source(src: str, name: str) -> str:
    """The text of `@triton.jit` function `name` in module source `src`."""
    return "def " + src.split(f"def {name}(", 1)[1].split("@triton.jit", 1)[0]


def part_code(src: str, name: str, full: bool) -> str:
    """Helper `name`'s body as a full (`full`) or a partial block compiles it: of each `if IS_FULL:` / `else:` /
    `if not IS_FULL:` statement at the body's level only the taken branch, dedented to the body's level."""
    out: list[str] = []
    branch: bool | None = None  # inside a top-level IS_FULL branch: is it the taken one?
    for line in helper_source(src, name).splitlines():
        if line in _HEADERS:
            branch = (not branch) if line == "    else:" else ((line == "    if IS_FULL:") == full)
            continue
        if branch is not None and line.startswith("        "):
            if branch:
                out.append(line[4:])
            continue
        branch = None
        out.append(line)
    return "\n".join(out)
