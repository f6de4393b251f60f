"""`load(SPEC | KERNEL_ID | OUT_DIR)`: a generated kernel as an imported module, ready to call (`kernel_kb.load`).

What `what` names decides what is loaded:
- a **spec file**: its candidate module `gen_<stem>.py` (the Triton module followed by `ModelNew`), taken from
  the generate cache (generate.cache) when it holds an entry for this spec, target, code, options and KB, else
  generated first (and cached). With `out`, the set is also published there and imported from there; without,
  it is imported from the cache entry.
- a **kernel id** `k-…`: the kernel's Triton module as the KB stores it (`Kernel.triton_src`: for a forward
  kernel the forward-only module, for a backward kernel the forward + backward module), written to
  `$KB_HOME/generated/kernels/` under a content-addressed name and imported. It has no `ModelNew` (whose
  state file belongs to a spec's output set): call its `forward` / `kb_attention` with the aux tensors.
- an **output directory** of `kb generate`: the one spec's candidate there (a directory holding several is an
  error naming them), or one of its files `OUT_DIR/gen_<stem>.py` / `gen_<stem>_triton.py` directly.
  A file counts as an output (not a spec) when its `gen_<stem>.report.json` lies beside it.

A module is imported under a name made of its file's stem and a digest of its resolved path and bytes (and
whether Triton interprets), kept in `sys.modules`: loading the same thing twice returns the same module object,
and a regenerated file (new bytes) a new module. Mistakes a user can make raise one-line `KBError`s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path
from types import ModuleType

from generate.cache import cache_key, cached_run, kernels_dir, lookup, specs_dir
from generate.outputs import staging_dir
from generate.pipeline import GenerateOptions, GenerateResult, resolve_target
from kb.errors import KBError
from kb.lower.runtime import import_file, mode_suffix
from kb.settings import Settings, load_settings
from kb.store.kb import KnowledgeBase, open_kb
from kb.store.models import Kernel

__all__ = ["load", "import_generated"]

_KERNEL_ID = re.compile(r"k-[0-9a-f]{16}")
_REPORT = ".report.json"


def load(what: str | os.PathLike[str], *, target: str = "auto", settings: Settings | None = None,
         home: str | os.PathLike[str] | None = None, out: str | os.PathLike[str] | None = None,
         backward: bool = True, force: bool = False) -> ModuleType:
    """The generated kernel module that `what` (a spec path, a kernel id or an output directory) names.

    `target`: the GPU arch a spec is generated for (auto: this machine's GPU, else `KB_TARGET_ARCH`);
    `settings` / `home`: the KB (default: the `KB_*` environment); `out`: also publish a spec's files there;
    `backward`: generate the backward too (a differentiable `kb_attention` and `ModelNew`); `force`: regenerate
    a spec even when the cache holds it."""
    path = Path(what)
    if not path.exists() and _KERNEL_ID.fullmatch(str(what)):
        return _by_kernel_id(str(what), _settings(settings, home))
    if path.is_dir():
        return import_generated(_candidate_in(path))
    if path.is_file():
        output = _output_file(path)
        if output is not None:
            return import_generated(output)
        return _by_spec(path, _settings(settings, home), target, None if out is None else Path(out), backward, force)
    raise KBError(f"{what}: no such spec file, output directory or kernel id (k- and 16 hex digits)")


def _settings(settings: Settings | None, home: str | os.PathLike[str] | None) -> Settings:
    if settings is not None and home is not None:
        raise KBError("give settings or home, not both")
    return settings or load_settings(home=home)


def _open(settings: Settings) -> KnowledgeBase:
    return open_kb(settings, create=False)


# ---------------------------------------------------------------- by spec


def _by_spec(spec: Path, settings: Settings, target: str, out: Path | None, backward: bool, force: bool) -> ModuleType:
    with _open(settings) as kb:
        options = GenerateOptions(target=resolve_target(target, settings.target_arch), timeout_s=settings.verify_timeout,
                                  backward=backward)
        if out is not None:
            result, _ = cached_run(kb, spec, replace(options, out_dir=out), force=force)
            _check(spec, result)
            return import_generated(result.files["candidate"])
        entry = None if force else lookup(kb, cache_key(kb, spec, options))
        if entry is None:
            specs_dir(settings).mkdir(parents=True, exist_ok=True)
            with staging_dir(specs_dir(settings)) as scratch:  # the run publishes here, the cache entry keeps a copy
                # force: the lookup above missed (or was skipped); cached_run need not look again
                result, entry = cached_run(kb, spec, replace(options, out_dir=scratch), force=True)
                _check(spec, result)
    assert entry is not None, "a succeeded run is cached"
    return import_generated(entry.file("candidate"))


def _check(spec: Path, result: GenerateResult) -> None:
    if not result.succeeded:
        first = (result.error or "no attempt passed").splitlines()[0][:300]
        raise KBError(f"no kernel could be generated for {spec}: {first}",
                      hint=f"`kb show {result.run_id}` has the run and its attempts")


# ---------------------------------------------------------------- by kernel id


def _by_kernel_id(kernel_id: str, settings: Settings) -> ModuleType:
    with _open(settings) as kb:
        row = kb.find(kernel_id)
    if not isinstance(row, Kernel):
        raise KBError(f"no kernel {kernel_id} in the KB at {settings.home}", hint="`kb show ID` lists what a KB holds")
    if not row.triton_src:
        raise KBError(f"kernel {kernel_id} ({row.name}, {row.origin}) holds no Triton module (a program without its lowering)",
                      hint="load the spec to generate a kernel")
    src = row.triton_src.encode()
    path = kernels_dir(settings) / f"{kernel_id}_{hashlib.sha256(src).hexdigest()[:12]}.py"
    if not path.is_file() or path.read_bytes() != src:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(src)
        os.replace(tmp, path)  # a concurrent loader never imports half a module
    return import_generated(path)


# ---------------------------------------------------------------- by output directory or file


def _report_of(path: Path) -> Path:
    stem = path.name.removesuffix(".py").removesuffix("_triton")
    return path.with_name(stem + _REPORT)


def _output_file(path: Path) -> Path | None:
    """`path` itself when it is a generated module of `kb generate --out` (its report beside it), else None."""
    if not (path.name.startswith("gen_") and path.suffix == ".py" and _report_of(path).is_file()):
        return None
    status = json.loads(_report_of(path).read_text()).get("status")
    if status == "failed":
        raise KBError(f"{path}: its report says the run failed; there is no kernel to load")
    return path


def _candidate_in(out_dir: Path) -> Path:
    """The one generated candidate of `out_dir` (a spec whose report is not `failed`)."""
    found = []
    for report in sorted(out_dir.glob("gen_*" + _REPORT)):
        cand = report.with_name(report.name.removesuffix(_REPORT) + ".py")
        if cand.is_file() and json.loads(report.read_text()).get("status") != "failed":
            found.append(cand)
    if not found:
        raise KBError(f"{out_dir} holds no generated kernel (a gen_<spec>.py beside a report that is not failed)")
    if len(found) > 1:
        names = ", ".join(str(c) for c in found)
        raise KBError(f"{out_dir} holds kernels of {len(found)} specs; load one of them: {names}")
    return found[0]


# ---------------------------------------------------------------- importing


def import_generated(path: Path) -> ModuleType:
    """Import the generated module at `path` under a name unique to its path and bytes; once per process."""
    path = path.resolve()
    digest = hashlib.sha256(str(path).encode() + b"\0" + path.read_bytes()).hexdigest()[:16]
    return import_file(path, f"kernel_kb_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}{mode_suffix()}")
