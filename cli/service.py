"""`kb serve`: the KB as an HTTP service (FastAPI + uvicorn), so that a query is a round trip to a warm process.

    POST /v1/query        {"text": "..."} or {"spec": "<spec file text>", "filename": "x.py"}, with k, mode, arch,
                          dtype, head_dim, memory as `kb query` takes them -> `kb query --json`'s object
    POST /v1/query/file   the same, the spec as a multipart file upload (field `file`, options as form fields)
    GET  /v1/records/{id} -> {"type", "record", "fields", "provenance", "lineage"} (`kb show`)
    GET  /v1/stats        -> `kb stats --json`'s object
    GET  /v1/health       -> {"status": "ok"} (no token needed)
    GET  /docs, /openapi.json: the API, as FastAPI documents it

Every error is one JSON object {"error": "<one line>"} with status 400 (a bad request or a KB error), 401 (no or a
wrong token), 404 (no such record) or 500 (a bug, logged here with its traceback, never sent). A spec's text is
someone else's code: it is traced by generate.spec_tracer's confined worker, never in this process, which holds
the KB's credentials. With a token (KB_SERVICE_TOKEN) every /v1 route but health requires
`Authorization: Bearer <token>`; binding beyond loopback without one is refused. The KB is opened once; requests
that touch it take turns (a hybrid query is tens of milliseconds), tracing runs beside them.
"""

from __future__ import annotations

import ipaddress

import typer

from cli.app import app, err, settings_of
from kb.errors import KBError

__all__ = ["serve", "is_loopback", "DEFAULT_PORT"]

DEFAULT_PORT = 8642


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command()
def serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="Address to listen on; beyond loopback a token (KB_SERVICE_TOKEN) is required."),
    port: int = typer.Option(DEFAULT_PORT, help="TCP port."),
    trace_timeout: float = typer.Option(30.0, "--trace-timeout", help="Seconds a spec may take to trace (CPU and wall "
                                        "clock); past them its tracer child is killed and the request answered 400."),
) -> None:
    """Serve query, show and stats over HTTP for `kb` clients (KB_SERVICE_URL) and other tools; API docs at /docs.

    Spec files sent to it are traced in a sandbox (no network, no Unix sockets, no KB credentials). Set
    KB_SERVICE_TOKEN to require `Authorization: Bearer <token>` (always required when --host is not loopback)."""
    import uvicorn

    from generate.spec_tracer import SpecTracer
    from kb.embed import get_embedder
    from kb.store import open_kb

    settings = settings_of(ctx)
    if settings.service_url:
        raise KBError("KB_SERVICE_URL is set: `kb serve` opens the KB itself", hint="unset KB_SERVICE_URL to serve")
    if not is_loopback(host) and not settings.service_token:
        raise KBError(f"--host {host} reaches beyond this machine: set KB_SERVICE_TOKEN to a secret token first")
    if not 0 < port < 65536:
        raise KBError(f"--port must be between 1 and 65535, not {port}")
    if not 1 <= trace_timeout <= 600:
        raise KBError(f"--trace-timeout must be between 1 and 600 seconds, not {trace_timeout}")
    _check_bind(host, port)
    tracer = SpecTracer(timeout_s=trace_timeout)
    with open_kb(settings) as kb:
        err.print("kb serve: loading the embedding model and the spec tracer ...")
        get_embedder(settings).embed(["warm-up"])
        tracer.start()
        from cli.service_app import create_app

        api = create_app(kb, tracer, settings.service_token)
        err.print(f"kb serve: specs are traced confined ({tracer.isolation.summary() if tracer.isolation else '?'})",
                  markup=False)
        auth = "token required" if settings.service_token else "no token (loopback only)"
        err.print(f"kb serve: listening on http://{host}:{port} ({auth}); API docs at /docs", markup=False)
        try:
            uvicorn.run(api, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
        finally:
            tracer.close()


def _check_bind(host: str, port: int) -> None:
    """A one-line error now for an address that cannot be bound (in use, not this machine's), before loading anything."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise KBError(f"cannot listen on {host}:{port}: {error}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            raise KBError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
