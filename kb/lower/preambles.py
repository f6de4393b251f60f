"""The runtime texts pasted into generated modules, read from the kb/lower modules that hold them between markers."""

from __future__ import annotations

from pathlib import Path

__all__ = ["preamble_text"]


def preamble_text(module_file: str) -> str:
    """The runtime text a module of kb/lower (`module_file`, e.g. "triton_preamble.py") holds between its preamble
    markers, pasted into generated modules (read as text: generating a module imports neither torch nor triton)."""
    text = (Path(__file__).parent / module_file).read_text()
    begin = text.index("\n", text.index("# ---- generated modules: preamble begins")) + 1
    return text[begin:text.index("# ---- generated modules: preamble ends")]
