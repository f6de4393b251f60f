"""Compile generated CUDA C++ with nvcc: a shared library to load, or an object to check.

`build(source, out_dir, mode)` writes `<out_dir>/<name>_<sha12>.cu` and runs
`nvcc -std=c++17 -arch=<arch> -O3 --compiler-options -fPIC [-D...] [extra flags] -shared` (or `-c`
for OBJECT, `-ptx` for PTX). An arch-specific target such as `sm_90a` (wgmma, setmaxnreg) is
passed in the `-gencode=arch=compute_90a,code=sm_90a` form, which nvcc 13.0 assembles without
a plain sm_90 pass.
The result is a typed `BuildResult`; a compile error is a result (status COMPILE_ERROR with
nvcc's log), not an exception, so callers can feed the log back to a generator. Only a
missing nvcc raises `KBError` (from `find_nvcc`), because nothing can be done without it.

Invariants: the artefact name carries the sha256 of source + flags, so a cached library is
never stale; an existing artefact is reused without running nvcc (`cached=True`); nvcc writes
to a temporary name that is renamed into place, so a concurrent reader never loads half a file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from kb.errors import KBError
from kb.lower.nvcc_preamble import _arch_flag, _find_nvcc

__all__ = ["BuildMode", "BuildStatus", "BuildResult", "build", "find_nvcc", "nvcc_command", "arch_flag", "DEFAULT_ARCH"]

log = logging.getLogger(__name__)

DEFAULT_ARCH = "sm_90"


class BuildMode(Enum):
    SHARED = "shared"  # a .so exporting kb_launch, for ctypes
    OBJECT = "object"  # compile only (-c): proves the source is valid CUDA C++
    PTX = "ptx"  # device code to PTX text (-ptx), for checking which instructions were emitted


class BuildStatus(Enum):
    OK = "ok"
    COMPILE_ERROR = "compile_error"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class BuildResult:
    status: BuildStatus
    artefact: Path | None  # the .so or .o on success
    source_path: Path
    command: tuple[str, ...]
    log: str  # nvcc's stdout + stderr (warnings on success, errors otherwise)
    seconds: float
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.status is BuildStatus.OK


def find_nvcc() -> str:
    """The nvcc executable: $KB_NVCC, $CUDA_HOME/bin/nvcc, nvcc on PATH or /usr/local/cuda/bin/nvcc (as generated
    modules find it: kb.lower.nvcc_preamble)."""
    found = _find_nvcc()
    if found is None:
        raise KBError("nvcc was not found; install the CUDA toolkit, or set KB_NVCC or CUDA_HOME to point at it")
    return found


_MODE_FLAG = {BuildMode.SHARED: "-shared", BuildMode.OBJECT: "-c", BuildMode.PTX: "-ptx"}
_MODE_SUFFIX = {BuildMode.SHARED: ".so", BuildMode.OBJECT: ".o", BuildMode.PTX: ".ptx"}


def arch_flag(arch: str) -> str:
    """`-arch=sm_90` for a family target; `-gencode=arch=compute_90a,code=sm_90a` for `sm_90a`."""
    return _arch_flag(arch)


def nvcc_command(src: Path, out: Path, mode: BuildMode, arch: str = DEFAULT_ARCH, opt: str = "-O3",
                 nvcc: str | None = None, defines: tuple[str, ...] = (),
                 extra_flags: tuple[str, ...] = ()) -> list[str]:
    cmd = [nvcc or find_nvcc(), "-std=c++17", arch_flag(arch), opt, "--compiler-options", "-fPIC"]
    cmd += [f"-D{d}" for d in defines]
    cmd += list(extra_flags)
    cmd += [_MODE_FLAG[mode]]
    return cmd + ["-o", str(out), str(src)]


def build(source: str, out_dir: Path, mode: BuildMode = BuildMode.SHARED, *, name: str = "kernel",
          arch: str = DEFAULT_ARCH, opt: str = "-O3", defines: tuple[str, ...] = (),
          extra_flags: tuple[str, ...] = (), timeout_s: float = 600.0) -> BuildResult:
    """Compile `source` into `out_dir` (created if needed); see the module docstring."""
    nvcc = find_nvcc()
    out_dir.mkdir(parents=True, exist_ok=True)
    key = f"{source}\0{mode.value}\0{arch}\0{opt}\0{defines}" + (f"\0{extra_flags}" if extra_flags else "")
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    stem = f"{name}_{digest}"
    src = out_dir / f"{stem}.cu"
    artefact = out_dir / f"{stem}{_MODE_SUFFIX[mode]}"
    if not src.exists() or src.read_text() != source:
        src.write_text(source)
    tmp = artefact.with_name(f".{artefact.name}.{os.getpid()}.tmp")
    cmd = nvcc_command(src, tmp, mode, arch, opt, nvcc, defines, extra_flags)
    if artefact.exists():
        return BuildResult(BuildStatus.OK, artefact, src, tuple(cmd), "", 0.0, cached=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        tmp.unlink(missing_ok=True)
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return BuildResult(BuildStatus.TIMEOUT, None, src, tuple(cmd), out + f"\nnvcc ran past {timeout_s:.0f} s",
                           time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    text = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        log.info("nvcc failed on %s (%.1f s)", src, seconds)
        return BuildResult(BuildStatus.COMPILE_ERROR, None, src, tuple(cmd), text, seconds)
    tmp.replace(artefact)
    log.debug("built %s in %.1f s", artefact, seconds)
    return BuildResult(BuildStatus.OK, artefact, src, tuple(cmd), text, seconds)
