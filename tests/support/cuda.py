"""The CUDA toolchain for tests that build kernels: nvcc, or a skip that says why it is absent."""

from __future__ import annotations

import pytest

from kb.errors import KBError
from kb.lower.cuda_build import find_nvcc

__all__ = ["nvcc_or_skip"]


def nvcc_or_skip() -> str:
    """The nvcc to build with; skips the calling test when there is none."""
    try:
        return find_nvcc()
    except KBError as err:
        pytest.skip(f"nvcc is absent: {err}")
