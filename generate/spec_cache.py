"""What a spec file traces to, remembered: `kb query SPEC` asked again skips tracing, and with it torch.

Tracing a spec imports torch and the tracer (about 1 s on 2 cores) and runs the spec (generate.spec_fx records
its ops, about 0.06 s for examples/specs/prefix_lm.py); the ranking needs only the features and variant
expressions it yields. This module imports neither: a hit reads one JSON file, and a miss traces in a forked
child while the caller starts up (`start_trace`).

The key is a sha256 over the spec file's bytes, the bytes of every other `.py` file in its directory (a spec
may import a sibling), and a digest of the code that traces (kb/ and generate/): an edit to any of them misses.
Entries live in `$KB_CACHE_DIR/spec-traces/` (default `$KB_HOME/cache/`), one JSON file each, written
atomically, read strictly (a damaged entry is traced again and rewritten); deleting them is always safe.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from kb.digests import code_digest
from kb.errors import KBError
from kb.features import Features, features_from_untrusted

__all__ = ["TracedSpec", "traced_json", "PendingTrace", "trace_spec_file", "start_trace", "trace_key", "remember_trace"]

log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[1]
FORMAT = "1"


@dataclass(frozen=True)
class TracedSpec:
    """What retrieval needs of a traced spec."""

    features: Features
    score_mod: str | None
    mask_mod: str | None

    @classmethod
    def from_untrusted(cls, data: object) -> TracedSpec:
        """From a JSON object someone else wrote ({"features": "<Features JSON>", "score_mod", "mask_mod"}): every
        field of its declared type; ValueError otherwise."""
        if not isinstance(data, dict):
            raise ValueError("not an object")
        score, mask = data.get("score_mod"), data.get("mask_mod")
        if not all(v is None or isinstance(v, str) for v in (score, mask)):
            raise ValueError("variant expressions are not text")
        return cls(features_from_untrusted(data.get("features")), score, mask)


@functools.cache
def _tracer_digest() -> str:
    return code_digest([_ROOT / "kb", _ROOT / "generate"])


def trace_key(path: Path) -> str:
    """The cache key of the spec at `path` (see module docstring); KBError when it cannot be read."""
    h = hashlib.sha256(f"{FORMAT}\0{_tracer_digest()}\0".encode())
    try:
        h.update(path.read_bytes())
        for sibling in sorted(p for p in path.resolve().parent.glob("*.py") if p.name != path.name):
            h.update(f"\0{sibling.name}\0".encode())
            h.update(sibling.read_bytes())
    except OSError as err:
        raise KBError(f"cannot read spec file {path}: {err.strerror or err}") from None
    return h.hexdigest()


def trace_spec_file(path: Path, cache_dir: Path) -> TracedSpec:
    """The spec's features and variant expressions: from the cache, else traced (generate.spec) and stored."""
    entry = _entry(path, cache_dir)
    hit = _read(entry)
    if hit is not None:
        return hit
    from generate.spec import load_spec  # noqa: PLC0415  torch and the tracer load only on a cache miss

    spec = load_spec(path)
    traced = TracedSpec(spec.features, *spec.variant_strings())
    _write(entry, traced)
    return traced


class PendingTrace:
    """A spec's trace under way in a forked child (see `start_trace`), or already known. `result()` waits for it;
    leaving the `with` block first (an error elsewhere, Ctrl-C) stops and reaps the child."""

    def __init__(self, path: Path, cache_dir: Path, known: TracedSpec | None = None) -> None:
        self.path, self.cache_dir, self.known = path, cache_dir, known
        self.pid: int | None = None
        self.pipe: int | None = None

    def __enter__(self) -> PendingTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = None
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None

    def result(self) -> TracedSpec:
        """The trace; KBError as `trace_spec_file` raises it (the child's message, unchanged)."""
        if self.known is not None:
            return self.known
        if self.pid is None:  # traced here (no fork)
            self.known = trace_spec_file(self.path, self.cache_dir)
            return self.known
        assert self.pipe is not None
        with os.fdopen(self.pipe) as f:
            self.pipe, text = None, f.read()
        os.waitpid(self.pid, 0)
        self.pid = None
        try:
            answer = json.loads(text)
        except ValueError:
            answer = {"ok": False, "bug": True}
        if answer.get("bug"):
            raise RuntimeError(f"tracing {self.path} failed in its child process (see its traceback above)")
        if not answer.get("ok"):
            raise KBError(str(answer.get("error")))
        self.known = TracedSpec.from_untrusted(answer)
        return self.known

    def fork(self) -> None:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _trace_in_child(self.path, self.cache_dir, write_end)
        os.close(write_end)
        self.pid, self.pipe = pid, read_end


def _trace_in_child(path: Path, cache_dir: Path, out_fd: int) -> NoReturn:
    """Trace, write one JSON answer, exit without the parent's exit handlers."""
    code = 0
    try:
        answer = {"ok": True, **traced_json(trace_spec_file(path, cache_dir))}
    except KBError as err:
        answer = {"ok": False, "error": str(err)}
    except BaseException:  # a bug: its traceback, here
        traceback.print_exc()
        answer, code = {"ok": False, "bug": True}, 1
    with os.fdopen(out_fd, "w") as f:
        f.write(json.dumps(answer))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_trace(path: Path, cache_dir: Path) -> PendingTrace:
    """`trace_spec_file` begun in a forked child, so that the caller's own start-up (the KB, the embedder) runs
    beside torch's import; a cache hit is known at once. The child runs the spec exactly as `trace_spec_file`
    would here. Without fork, or once torch is imported (a fork would copy its threads), `result()` traces here."""
    pending = PendingTrace(path, cache_dir, _read(_entry(path, cache_dir)))
    if pending.known is None and hasattr(os, "fork") and "torch" not in sys.modules:
        pending.fork()
    return pending


def remember_trace(path: Path, traced: TracedSpec, cache_dir: Path) -> None:
    """Store what `path` traced to where `trace_spec_file` looks (`kb generate` traced it anyway), so a later
    `kb query` of the same spec skips tracing; an unreadable spec or cache only means no entry."""
    try:
        entry = _entry(path, cache_dir)
    except KBError:
        return
    _write(entry, traced)


def _entry(path: Path, cache_dir: Path) -> Path:
    return cache_dir / "spec-traces" / f"{trace_key(path)}.json"


def traced_json(traced: TracedSpec) -> dict[str, str | None]:
    """What an entry holds, and what a tracing child or the service's worker answers (`TracedSpec.from_untrusted`
    reads it back)."""
    return {"features": traced.features.to_json(), "score_mod": traced.score_mod, "mask_mod": traced.mask_mod}


def _read(entry: Path) -> TracedSpec | None:
    try:
        return TracedSpec.from_untrusted(json.loads(entry.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.info("spec trace cache: ignoring %s (%s)", entry, err)
        return None


def _write(entry: Path, traced: TracedSpec) -> None:
    """Store atomically; a cache that cannot be written is only slower, never an error."""
    text = json.dumps(traced_json(traced))
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, entry)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        log.info("spec trace cache: cannot write %s (%s)", entry, err)
