"""A small OpenAI-compatible chat-completions server with scripted answers, for tests.

A real `http.server.ThreadingHTTPServer` on 127.0.0.1 (ephemeral port) serving
`POST /v1/chat/completions` and `GET /v1/models` in the OpenAI response shapes, so the real
`openai` client (and any other process) talks to it over real HTTP.

Invariants:
- Each chat request takes the next scripted `Reply` from the queue, in order; when the queue is
  empty the server answers HTTP 500 "no scripted reply left", so an unexpected extra request
  fails the test loudly instead of hanging (unless `repeat_last`: then the last reply repeats).
- Every request body (parsed JSON) is recorded in `requests`, in arrival order, before any delay.
- A delayed reply waits on the server's closing event, so `close()` never waits for a sleeper;
  after `close()` the port is released and no thread of the server is left serving.

Run standalone (`python -m tests.support.fake_llm_server 'answer text' ...`) to serve fixed answers
in order, the last one repeating, until interrupted, e.g. to try `kb generate --engine llm` by hand.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Reply", "answer", "http_error", "delayed", "FakeLLMServer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reply:
    """One scripted reply: answer `text` with HTTP 200, or fail with `status`; first wait `delay_s`."""

    text: str = ""
    status: int = 200
    delay_s: float = 0.0
    error_message: str = "scripted error"


def answer(text: str) -> Reply:
    return Reply(text=text)


def http_error(status: int, message: str = "scripted error") -> Reply:
    return Reply(status=status, error_message=message)


def delayed(seconds: float, text: str = "late answer") -> Reply:
    return Reply(text=text, delay_s=seconds)


def _completion(model: str, text: str, prompt_chars: int) -> dict[str, Any]:
    prompt_tokens, completion_tokens = max(1, prompt_chars // 4), max(1, len(text) // 4)
    return {
        "id": f"chatcmpl-fake-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("fake llm: " + format, *args)

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            log.debug("fake llm: client went away before the reply (timed out?)")

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "type": "fake_error", "code": status}})

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list", "data": [
                {"id": self.server.owner.model, "object": "model", "created": 0, "owned_by": "fake"}]})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._error(404, f"no route {self.path}")
            return
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            self._error(400, "body is not JSON")
            return
        owner = self.server.owner
        owner.requests.append(body)
        try:
            reply = owner.replies.get_nowait()
            owner.last = reply
        except queue.Empty:
            if not (owner.repeat_last and owner.last):
                self._error(500, "no scripted reply left")
                return
            reply = owner.last
        if reply.delay_s and owner.closing.wait(reply.delay_s):
            return  # server closing: drop the connection
        if reply.status != 200:
            self._error(reply.status, reply.error_message)
            return
        prompt_chars = sum(len(str(m.get("content", ""))) for m in body.get("messages", []))
        self._send(200, _completion(body.get("model", owner.model), reply.text, prompt_chars))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: "FakeLLMServer"


class FakeLLMServer:
    """Context manager: `with FakeLLMServer() as srv: srv.script(answer("..."))`; `srv.base_url`."""

    def __init__(self, model: str = "fake-model", *, repeat_last: bool = False) -> None:
        self.model = model
        self.repeat_last = repeat_last
        self.last: Reply | None = None
        self.requests: list[dict[str, Any]] = []
        self.replies: queue.Queue[Reply] = queue.Queue()
        self.closing = threading.Event()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-llm-server", daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, *replies: Reply | str) -> None:
        """Queue replies (a plain string is an answer)."""
        for r in replies:
            self.replies.put(answer(r) if isinstance(r, str) else r)

    @property
    def pending(self) -> int:
        return self.replies.qsize()

    def start(self) -> "FakeLLMServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self.closing.set()
        if self._thread.is_alive():
            self._httpd.shutdown()  # blocks until serve_forever returns; never call it unstarted
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "FakeLLMServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    import sys

    with FakeLLMServer(repeat_last=True) as srv:
        srv.script(*sys.argv[1:])
        print(f"serving {srv.pending} scripted answers (the last one repeats) at {srv.base_url} "
              f"(model {srv.model}); Ctrl-C stops")
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
