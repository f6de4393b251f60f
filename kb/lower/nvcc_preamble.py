"""nvcc for generated modules and for kernel-kb itself: where it is, the arch flag, and a build cached by content.

The text between the marker lines is pasted into a generated module that dispatches to a `.cu` (before
kb.lower.cuda_dispatch_preamble's text); kb.lower.cuda_build imports `_find_nvcc` and `_arch_flag` from here, so that
kernel-kb and the modules it writes find nvcc and spell the arch the same way. Standard library only (no torch): the
CPU machine that generates and compiles kernels imports it.
"""

import os

# ---- generated modules: preamble begins (nvcc; pasted byte for byte; edit only between these lines) ----
import hashlib
import shutil
import subprocess


class _CudaUnavailable(Exception):
    """Why the `.cu` cannot run on this machine; the Triton kernels run instead."""


def _find_nvcc():
    """nvcc from $KB_NVCC, $CUDA_HOME/bin, PATH or /usr/local/cuda/bin; None when there is none."""
    home = os.environ.get("CUDA_HOME")
    for c in (os.environ.get("KB_NVCC"), home and os.path.join(home, "bin", "nvcc"), shutil.which("nvcc"),
              "/usr/local/cuda/bin/nvcc"):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _arch_flag(arch):
    """`-arch=sm_80` for a family target; `-gencode=arch=compute_90a,code=sm_90a` for an arch-specific one (wgmma)."""
    if arch.startswith("sm_") and arch.endswith("a"):
        return f"-gencode=arch=compute_{arch[3:]},code={arch}"
    return f"-arch={arch}"


def _cuda_build(source_path, arch, defines=()):
    """The shared library built from `source_path` for `arch`, once: under $KB_CACHE_DIR/cuda (default
    ~/.cache/kernel-kb/cuda), named by the sha256 of the source and the flags (never stale); nvcc writes a temporary
    file that is renamed into place, so a concurrent reader never loads half a library."""
    nvcc = _find_nvcc()
    if nvcc is None:
        raise _CudaUnavailable("nvcc was not found (set KB_NVCC or CUDA_HOME, or put nvcc on PATH)")
    try:
        with open(source_path, encoding="utf-8") as f:
            source = f.read()
    except OSError as err:
        raise _CudaUnavailable(f"cannot read {source_path}: {err.strerror or err}") from None
    flags = ["-std=c++17", _arch_flag(arch), "-O3", "--compiler-options", "-fPIC", *(f"-D{d}" for d in defines),
             "-shared"]
    digest = hashlib.sha256("\0".join([source, *flags]).encode()).hexdigest()[:12]
    root = os.environ.get("KB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kernel-kb")
    stem = os.path.join(root, "cuda", f"{os.path.splitext(os.path.basename(source_path))[0]}_{digest}")
    if os.path.exists(stem + ".so"):
        return stem + ".so"
    tmp = f"{stem}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(stem), exist_ok=True)
        with open(stem + ".cu", "w", encoding="utf-8") as f:
            f.write(source)
        proc = subprocess.run([nvcc, *flags, "-o", tmp, stem + ".cu"], capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise _CudaUnavailable(f"cannot build {source_path}: {err}") from None
    if proc.returncode != 0:
        lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "error" in x] or ["(no message)"]
        raise _CudaUnavailable(f"nvcc could not build {source_path}: {lines[0].strip()}")
    os.replace(tmp, stem + ".so")
    return stem + ".so"
# ---- generated modules: preamble ends ----
