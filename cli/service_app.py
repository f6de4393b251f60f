"""The FastAPI application of `kb serve` (cli.service says what each route answers).

No `from __future__ import annotations` here: FastAPI reads the route functions' annotations at run time, and
the request models are module-level so that it can resolve them.
"""

import hmac
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Depends, FastAPI, File, Form, Header, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from cli.answers import check_query_args, query_answer, show_answer, stats_answer
from generate.spec_tracer import MAX_SPEC_BYTES, SpecTracer
from kb.errors import KBError
from kb.store import KnowledgeBase
from retrieve.hybrid import describe_target

__all__ = ["create_app", "QueryRequest"]

log = logging.getLogger(__name__)


class QueryRequest(BaseModel):
    """A query: free text or a spec file's text, with `kb query`'s options."""

    text: str | None = Field(default=None, description="Free text, as `kb query TEXT`.")
    spec: str | None = Field(default=None, description="A spec file's text, as `kb query SPEC.py`.")
    filename: str = Field(default="spec.py", description="The spec file's name (for messages).")
    k: int = 5
    mode: str = "hybrid"
    arch: str | None = None
    dtype: str | None = None
    head_dim: int | None = None
    memory: bool = True


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Service:
    """The open KB (used by one request at a time) and the spec tracer."""

    def __init__(self, kb: KnowledgeBase, tracer: SpecTracer) -> None:
        self.kb, self.tracer = kb, tracer
        self._lock = threading.Lock()

    @contextmanager
    def store(self) -> Iterator[KnowledgeBase]:
        with self._lock:
            yield self.kb


def create_app(kb: KnowledgeBase, tracer: SpecTracer, token: str = "") -> FastAPI:
    """The FastAPI application over an open KB; `token`: the bearer token every /v1 route but health requires."""
    service = _Service(kb, tracer)
    api = FastAPI(title="kernel-kb", summary="Query a knowledge base of expert GPU attention kernels.", version="1")

    @api.exception_handler(_Refused)
    def _refused(_: Request, exc: _Refused) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @api.exception_handler(KBError)
    def _kb_error(_: Request, exc: KBError) -> JSONResponse:
        status = 404 if str(exc).startswith("no record with id") else 400
        return JSONResponse({"error": str(exc)}, status_code=status)

    @api.exception_handler(RequestValidationError)
    def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse({"error": f"bad request: {where or 'body'}: {first.get('msg', 'invalid')}"}, status_code=400)

    @api.exception_handler(StarletteHTTPException)
    def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @api.exception_handler(Exception)
    def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("kb serve: request failed")
        return JSONResponse({"error": f"internal error ({type(exc).__name__}); see the service's log"}, status_code=500)

    def authorised(authorization: str | None = Header(default=None)) -> None:
        if not token:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise _Refused(401, "a valid bearer token is required (Authorization: Bearer <KB_SERVICE_TOKEN>)")

    def answer(req: QueryRequest) -> dict[str, Any]:
        check_query_args(req.k, req.mode)
        if (req.text is None) == (req.spec is None):
            raise _Refused(400, "give exactly one of text and spec")
        target, text = None, req.text or ""
        if req.spec is not None:
            traced = tracer.trace(req.spec, req.filename)
            target, text = traced.features, describe_target(traced.features, traced.score_mod, traced.mask_mod)
        elif not text.strip():
            raise _Refused(400, "the query text is empty")
        with service.store() as store:
            return query_answer(store, text, target, k=req.k, mode=req.mode, arch=req.arch, dtype=req.dtype,
                                head_dim=req.head_dim, memory=req.memory)

    @api.get("/v1/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.post("/v1/query", dependencies=[Depends(authorised)])
    def query(req: QueryRequest) -> dict[str, Any]:
        """Rank kernels for free text or a spec file's text (`kb query --json`'s answer)."""
        return answer(req)

    @api.post("/v1/query/file", dependencies=[Depends(authorised)])
    def query_file(file: UploadFile = File(...), k: int = Form(5), mode: str = Form("hybrid"),
                   arch: str | None = Form(None), dtype: str | None = Form(None),
                   head_dim: int | None = Form(None), memory: bool = Form(True)) -> dict[str, Any]:
        """Rank kernels for an uploaded spec file."""
        raw = file.file.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            raise _Refused(400, f"spec file is larger than {MAX_SPEC_BYTES // 1024} KiB")
        try:
            source = raw.decode()
        except UnicodeDecodeError:
            raise _Refused(400, "spec file is not UTF-8 text") from None
        return answer(QueryRequest(spec=source, filename=file.filename or "spec.py", k=k, mode=mode, arch=arch,
                                   dtype=dtype, head_dim=head_dim, memory=memory))

    @api.get("/v1/records/{record_id}", dependencies=[Depends(authorised)])
    def record(record_id: str) -> dict[str, Any]:
        """One record (`kb show`)."""
        with service.store() as store:
            return show_answer(store, record_id)

    @api.get("/v1/stats", dependencies=[Depends(authorised)])
    def stats() -> dict[str, Any]:
        """Rows per table and embeddings per collection (`kb stats --json`)."""
        with service.store() as store:
            return stats_answer(store)

    return api


