"""nvcc on the `.cu` that `kb generate` writes (object only: no GPU needed), as a typed result.

It runs once per run, on the kernel that passed, before the write-back: the kernel's KB row records
the result in its `verify_note`, the report in its `cuda` section.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from kb.errors import KBError
from kb.ir.design import head_bucket
from kb.lower.cuda_build import BuildMode, build

__all__ = ["CudaCompile", "NOT_COMPILED", "compile_cuda"]


@dataclass(frozen=True)
class CudaCompile:
    """What nvcc said about the `.cu`."""

    compiled: bool
    status: str  # a kb.lower.cuda_build.BuildStatus value, or "not_run" (no .cu, not asked, no nvcc here)
    seconds: float | None = None
    command: str | None = None
    log: str | None = None  # nvcc's output (its last 2,000 characters), or why it did not run

    def as_dict(self) -> dict:
        """The report's fields (those known)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


NOT_COMPILED = CudaCompile(False, "not_run")


def compile_cuda(source: str, out_dir: Path, head_dim: int, head_dim_v: int | None = None, *,
                 arch: str = "sm_90") -> CudaCompile:
    """Compile the CUDA source with nvcc for the spec's head dims (`head_dim_v`: a value head dim of its own)."""
    defines: tuple[str, ...] = (f"KB_HEAD_PAD_ONLY={head_bucket(head_dim)}",)
    if head_dim_v is not None:
        defines += (f"KB_HEAD_PAD_V_ONLY={head_bucket(head_dim_v)}",)
    try:
        res = build(source, out_dir / "cuda-build", BuildMode.OBJECT, name="kernel", opt="-O1", arch=arch,
                    defines=defines, timeout_s=300)
    except KBError as err:  # no nvcc on this machine
        return CudaCompile(False, "not_run", log=str(err))
    return CudaCompile(res.ok, res.status.value, round(res.seconds, 1), " ".join(res.command), res.log[-2000:])
