"""Trace spec text from someone else, confined: the service side of generate.spec_worker.

`SpecTracer` starts the worker in a verify.sandbox.Sandbox (the policy: no network, no Unix sockets, the
KB home and the user's home hidden, none of the service's KB_* settings or keys in its environment) and
sends it one spec at a time. What the worker answers is data from a process that ran untrusted code, so it
is parsed strictly: a Features object whose every field has its declared type, variant strings or null.
A worker that died (killed, out of CPU time) is started again on the next request. Answers are kept for the
last `cache_size` distinct spec texts, so that asking again about the same spec does not trace it again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import threading
import time
from collections import OrderedDict
from typing import Any

from generate.spec_cache import TracedSpec
from kb.errors import KBError
from verify.sandbox import Isolation, Sandbox, SandboxPolicy

__all__ = ["SpecTracer", "TracedSpec"]

log = logging.getLogger(__name__)

MAX_SPEC_BYTES = 256 * 1024
_DAY_S = 24 * 3600


class SpecTracer:
    """One confined tracing worker, started on first use; `trace` is safe to call from several threads."""

    def __init__(self, timeout_s: float = 30.0, start_timeout_s: float = 120.0, cache_size: int = 512) -> None:
        self.timeout_s, self.start_timeout_s, self.cache_size = timeout_s, start_timeout_s, cache_size
        self._known: OrderedDict[str, TracedSpec] = OrderedDict()
        self._lock = threading.Lock()
        self._box: Sandbox | None = None
        self._proc: Any = None
        self._next_id = 0
        self._buf = b""
        self.isolation: Isolation | None = None

    def start(self) -> None:
        """Start the worker now (else on the first `trace`) and wait for it to be ready."""
        with self._lock:
            self._ensure()

    def close(self) -> None:
        with self._lock:
            self._stop()
            if self._box is not None:
                self._box.__exit__(None, None, None)
                self._box = None

    def trace(self, source: str, filename: str = "spec.py") -> TracedSpec:
        """The spec text's features and variant expressions; KBError with the tracer's one-line reason."""
        if len(source.encode()) > MAX_SPEC_BYTES:
            raise KBError(f"spec text is larger than {MAX_SPEC_BYTES // 1024} KiB")
        key = hashlib.sha256(f"{filename}\0{source}".encode()).hexdigest()
        with self._lock:
            if key in self._known:
                self._known.move_to_end(key)
                return self._known[key]
            self._ensure()
            self._next_id += 1
            request = {"id": self._next_id, "source": source, "filename": filename, "timeout_s": self.timeout_s}
            answer = self._ask(request)
        if not answer.get("ok"):
            raise KBError(str(answer.get("error") or "the tracer gave no reason").splitlines()[0][:2000])
        try:
            traced = TracedSpec.from_untrusted(answer)
        except ValueError as err:
            raise KBError(f"the tracer answered bad data: {err}") from None
        with self._lock:
            self._known[key] = traced
            while len(self._known) > self.cache_size:
                self._known.popitem(last=False)
        return traced

    # ---- the worker (called with the lock held)
    def _ensure(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._stop()
        if self._box is None:
            self._box = Sandbox(SandboxPolicy(cpu_time_s=_DAY_S)).__enter__()
        self._proc, self.isolation = self._box.start("generate.spec_worker", [], self._box.workdir / "tracer.log")
        line = self._read_line(self.start_timeout_s)
        if line is None or line.strip() != '{"ready": true}':
            self._stop()
            raise KBError(f"the spec tracer did not start (see {self._box.workdir / 'tracer.log'})")
        log.info("spec tracer ready (%s)", self.isolation.summary())

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._stop()
            raise KBError("the spec tracer stopped; try again") from None
        while True:  # answers to earlier requests whose caller gave up are skipped
            line = self._read_line(self.timeout_s + 10.0)
            if line is None:
                self._stop()
                raise KBError("the spec tracer did not answer; it was restarted, try again")
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if isinstance(answer, dict) and answer.get("id") == request["id"]:
                return answer

    def _read_line(self, timeout_s: float) -> str | None:
        """One line of the worker's stdout within `timeout_s`, or None (timeout or end of stream). Reads the pipe's
        descriptor directly: a buffered reader could hold a second line where select() no longer sees it."""
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace")

    def _stop(self) -> None:
        if self._proc is not None:
            Sandbox.stop(self._proc)
            self._proc = None
        self._buf = b""
