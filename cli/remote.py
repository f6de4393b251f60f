"""The CLI's side of `kb serve`: with KB_SERVICE_URL set, `kb query`, `kb show` and `kb stats` are one HTTP round
trip to a warm service instead of loading torch, the embedding model and the store in this process.

Standard library only (urllib), so that a client starts in the time Python and the CLI take to import. A spec
file is sent as text and traced by the service in its sandbox: it must not import files beside it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kb.errors import KBError
from kb.redact import redact_url
from kb.settings import Settings

__all__ = ["call_service"]

_TIMEOUT_S = 120.0


def call_service(settings: Settings, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The service's JSON answer to `method path` (with a JSON body); KBError with its one-line error otherwise."""
    base = settings.service_url.rstrip("/")
    if urllib.parse.urlsplit(base).scheme not in ("http", "https"):
        raise KBError(f"KB_SERVICE_URL {redact_url(base)!r} is not an http(s) URL", hint="e.g. http://127.0.0.1:8642")
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if settings.service_token:
        headers["Authorization"] = f"Bearer {settings.service_token}"
    request = urllib.request.Request(base + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            return _json(response.read(), base)
    except urllib.error.HTTPError as err:
        answer = _json(err.read(), base, strict=False)
        message = answer.get("error") if isinstance(answer, dict) else None
        if err.code == 401:
            raise KBError(f"the KB service at {redact_url(base)} refused the request: {message or 'not authorised'}",
                          hint="set KB_SERVICE_TOKEN to the token the service was started with") from None
        raise KBError(str(message or f"the KB service at {redact_url(base)} answered HTTP {err.code}")) from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise KBError(f"cannot reach the KB service at {redact_url(base)}: {reason}",
                      hint="start it with `kb serve`, or unset KB_SERVICE_URL to open the KB in this process") from None


def _json(raw: bytes, base: str, strict: bool = True) -> dict[str, Any]:
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        if not strict:
            return {}
        raise KBError(f"the KB service at {redact_url(base)} answered something that is not a JSON object")
    return answer
