"""Load a lowered Triton module from a file and run it.

`TritonKernel.from_program(p)` lowers `p` (kb.lower.triton), writes the source to
`<cache_dir>/triton/<program>_<sha12>.py` (Triton's JIT reads kernel source with `inspect`,
so it must live in a real file) and imports it. `run(inputs)` calls the module's host
`forward` (a backward program's: `backward`, kb.lower.triton_bwd), which allocates outputs and scratch,
computes grids and launches the kernels.

Invariants: the file name carries the sha256 of the source, so a cached file is never
stale and two programs never share a module. `@triton.jit` makes interpreted or compiled
functions depending on `TRITON_INTERPRET` at the moment the module is imported, so the module
name also says which mode it was imported in: a module loaded for the interpreter is never
handed to a compiled launch, or the reverse. Set `TRITON_INTERPRET=1` before the first
`import triton` to run on CPU (Triton's own library functions are fixed at that import).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Mapping

import torch

from kb.errors import KBError
from kb.ir.nodes import Program, Role, is_backward
from kb.lower.triton import LowerOptions, lower_program
from kb.lower.triton_host import kernel_fn_name
from kb.settings import load_settings

__all__ = ["TritonKernel", "import_file", "load_module", "mode_suffix"]

log = logging.getLogger(__name__)


def _default_cache_dir() -> Path:
    try:
        return load_settings().cache_dir / "triton"
    except KBError:
        return Path(tempfile.gettempdir()) / "kernel-kb-triton"


def mode_suffix() -> str:
    """`_interp` when Triton interprets (`@triton.jit` binds the mode when a module is imported), else ''."""
    return "_interp" if os.environ.get("TRITON_INTERPRET") == "1" else ""


def import_file(path: Path, name: str) -> ModuleType:
    """The module at `path` imported as `name` and kept in sys.modules (Dynamo looks traced functions' modules up
    there); a second call with the same name returns the same module; a module that fails to import is not kept."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"{path} is a .py file"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def load_module(source: str, name: str, cache_dir: Path | None = None) -> tuple[ModuleType, Path]:
    """Write `source` to a content-addressed file under `cache_dir` and import it."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    mod_name = f"kb_triton_{name}_{digest}{mode_suffix()}"
    if mod_name in sys.modules:
        mod = sys.modules[mod_name]
        return mod, Path(mod.__file__ or "")
    directory = cache_dir or _default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{mod_name}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(source)
        tmp.replace(path)  # atomic: a concurrent reader never sees half a module
    mod = import_file(path, mod_name)
    log.debug("loaded %s from %s", mod_name, path)
    return mod, path


@dataclass(frozen=True)
class TritonKernel:
    """A Program lowered to Triton and imported; `run` launches it."""

    program: Program
    source: str
    path: Path
    module: ModuleType

    @classmethod
    def from_program(cls, p: Program, cache_dir: Path | None = None, options: LowerOptions | None = None) -> "TritonKernel":
        source = lower_program(p, options)
        module, path = load_module(source, p.name, cache_dir)
        return cls(p, source, path, module)

    @property
    def jit_functions(self) -> dict[str, object]:
        """The `@triton.jit` function of each IR kernel, by IR kernel name."""
        return {k.name: getattr(self.module, kernel_fn_name(k)) for k in self.program.kernels}

    def run(self, inputs: Mapping[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
        """Launch on `inputs` (input, aux tensors and scalars by param name; sm_scale optional).

        Returns the program's outputs by name (e.g. {"o": ..., "lse": ...}).
        """
        p = self.program
        ins = [q.name for q in p.params if q.role is Role.IN]
        missing = [n for n in ins if n not in inputs]
        if missing:
            raise KBError(f"program {p.name} needs input tensors {missing}; got {sorted(inputs)}")
        kwargs = {n: v for n, v in inputs.items() if n not in ins}
        if kwargs.get("sm_scale", 0) is None:
            del kwargs["sm_scale"]
        host = self.module.backward if is_backward(p) else self.module.forward
        try:
            result = host(*(inputs[n] for n in ins), **kwargs)
        except self.module.ForwardArgumentError as err:
            raise KBError(f"cannot run program {p.name}: {err}") from err
        # a backward module says its return order (dq, dk, dv, then aux gradients)
        outs = self.module.BWD_OUTPUTS if is_backward(p) else [q.name for q in p.params if q.role is Role.OUT]
        result = result if isinstance(result, tuple) else (result,)
        return dict(zip(outs, result))
