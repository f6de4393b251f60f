"""The CUDA toolchain for tests that build kernels: nvcc, or a skip that says why it is absent."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kb.errors import KBError
from kb.lower.cuda_build import find_nvcc

__all__ = ["nvcc_or_skip", "build_sm90a"]


def nvcc_or_skip() -> str:
    """The nvcc to build with; skips the calling test when there is none."""
    try:
        return find_nvcc()
    except KBError as err:
        pytest.skip(f"nvcc is absent: {err}")


def build_sm90a(nvcc: str, src: str, where: Path, *, shared: bool = False) -> tuple[str, str]:
    """`src` written to `where`/k.cu and built for sm_90a at -O3: (its PTX, ptxas's -v log of the object or, with
    `shared`, of the shared library followed by its dynamic symbols). Each nvcc failure fails the calling test."""
    flags = [nvcc, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Xptxas", "-v"]
    where.mkdir(parents=True, exist_ok=True)
    cu = where / "k.cu"
    cu.write_text(src)
    ptx = subprocess.run([*flags, "-ptx", "-o", str(where / "k.ptx"), str(cu)], capture_output=True, text=True, timeout=300)
    assert ptx.returncode == 0, ptx.stderr[-3000:]
    out = where / ("k.so" if shared else "k.o")
    kind = ["--shared", "-Xcompiler", "-fPIC"] if shared else ["-c"]
    built = subprocess.run([*flags, *kind, "-o", str(out), str(cu)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    syms = subprocess.run(["nm", "-D", str(out)], capture_output=True, text=True).stdout if shared else ""
    return (where / "k.ptx").read_text(), built.stdout + built.stderr + syms
