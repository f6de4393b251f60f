"""A warm spec tracer for `kb serve`: `python -m generate.spec_worker`, run inside a verify.sandbox.Sandbox.

A spec sent to the service is someone else's code, and tracing it runs it. The service starts this worker
confined (scrubbed environment, no network, no Unix sockets, the KB home hidden) once; the worker imports
the tracer and traces one example spec so that torch's tracing machinery is loaded, then answers requests:

    stdin:  {"id": 1, "source": "<spec file text>", "filename": "my_spec.py", "timeout_s": 30}   (one line each)
    stdout: {"id": 1, "ok": true, "features": "<Features JSON>", "score_mod": "...", "mask_mod": "..."}
            {"id": 1, "ok": false, "error": "<one line>"}

Each request is traced in a child forked before it came (a spec that patches torch or leaves threads behind does
not reach the next request), with a CPU-time limit and a wall-clock limit; the child is killed past either. The first
line the worker prints is {"ready": true}.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from generate.spec import load_spec
from generate.spec_cache import TracedSpec, traced_json
from kb.errors import KBError

__all__ = ["main", "trace_request"]

_WARM_SPEC = Path(__file__).resolve().parents[1] / "examples" / "specs" / "causal_d64.py"
_MAX_ANSWER = 1 << 20  # bytes a child may answer with


def trace_request(request: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Trace one spec's text in this process: the answer line (see module docstring)."""
    name = Path(str(request.get("filename") or "spec.py")).name
    if not name.endswith(".py"):
        name += ".py"
    folder = workdir / f"req-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(str(request.get("source", "")))
    try:
        spec = load_spec(path)
    except KBError as err:
        return {"ok": False, "error": str(err).replace(str(folder) + "/", "")}
    return {"ok": True, **traced_json(TracedSpec(spec.features, *spec.variant_strings()))}


class _Spare:
    """A child forked ahead of its request (the fork of a process holding torch costs tens of milliseconds), waiting
    for one request on its pipe; it traces it under a CPU-time limit and answers on another pipe."""

    def __init__(self, workdir: Path) -> None:
        req_r, self.req_w = os.pipe()
        self.ans_r, ans_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.setpgid(0, 0)  # its own group: whatever the spec starts dies with it
            os.close(self.req_w)
            os.close(self.ans_r)
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)  # the worker's stdout carries answers: a spec printing there could forge one
            os.dup2(quiet, 2)
            _serve_one(req_r, ans_w, workdir)  # never returns
        os.close(req_r)
        os.close(ans_w)

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send the request; the child's answer within its `timeout_s`, or a one-line failure. Reaps the child."""
        timeout = _timeout(request)
        chunks, deadline = [], time.monotonic() + timeout
        try:
            os.write(self.req_w, json.dumps(request).encode())
            os.close(self.req_w)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.ans_r], [], [], left)[0]:
                    return {"ok": False, "error": f"tracing the spec took longer than {timeout:g} s"}
                chunk = os.read(self.ans_r, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError as err:
            return {"ok": False, "error": f"the tracer's child failed: {err.strerror or err}"}
        finally:
            self.close()
        try:
            answer = json.loads(b"".join(chunks))
        except ValueError:
            return {"ok": False, "error": "tracing the spec crashed the tracer (no answer)"}
        return answer if isinstance(answer, dict) else {"ok": False, "error": "the tracer answered no object"}

    def close(self) -> None:
        for fd in (self.req_w, self.ans_r):
            try:
                os.close(fd)
            except OSError:
                pass
        for kill in (os.killpg, os.kill):  # the child's group, and the child should it not have made one yet
            try:
                kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os.waitpid(self.pid, 0)


def _timeout(request: dict[str, Any]) -> float:
    try:
        return max(1.0, min(float(request.get("timeout_s") or 30.0), 600.0))
    except (TypeError, ValueError):
        return 30.0


def _serve_one(req_r: int, ans_w: int, workdir: Path) -> None:
    """The spare child: read one request, trace it, answer, and leave without running the parent's exit handlers."""
    code = 0
    try:
        raw = b""
        while chunk := os.read(req_r, 65536):
            raw += chunk
        if not raw:  # the worker is stopping
            os._exit(0)
        request = json.loads(raw)
        limit = int(_timeout(request)) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit))
        try:
            answer = trace_request(request, workdir)
        except BaseException as err:
            answer = {"ok": False, "error": f"tracing the spec failed: {type(err).__name__}: {err}"}
        os.write(ans_w, json.dumps(answer).encode()[:_MAX_ANSWER])
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def main() -> int:
    torch.set_num_threads(1)  # no thread pool to copy into the forked children
    workdir = Path.cwd()
    if _WARM_SPEC.is_file():  # loads the tracer's imports once, here
        trace_request({"source": _WARM_SPEC.read_text(), "filename": _WARM_SPEC.name}, workdir)
    spare = _Spare(workdir)
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            try:
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ValueError("not an object")
            except ValueError as err:
                print(json.dumps({"id": None, "ok": False, "error": f"bad request line: {err}"}), flush=True)
                continue
            answer = spare.answer(request)
            print(json.dumps({"id": request.get("id"), **answer}), flush=True)
            spare = _Spare(workdir)  # the next one forks while the service ranks this answer
    finally:
        spare.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
