"""Credentials never reach text: the one place URLs are redacted before they are printed, logged or stored.

`redact_url` hides a URL's user-info (`postgresql://kb:***@db/kernels`, `http://***@host/v1`) and the values
of query parameters that name a secret (`?password=***`, `?api_key=***`). `redact_text` does the same to every
URL inside free text (error messages, log lines, stored run errors), and to libpq-style `password=...` pairs.
`RedactingFilter` applies `redact_text` to log records.

Invariants:
- Redaction only removes: host, port, path and the other query parameters stay, so a message still says
  which server it is about. When in doubt (a password holding `@`, `/` or `?`), more is hidden, never less.
- A string that is not `scheme://...` (a malformed setting) keeps only what precedes its first `:`, since
  the rest may be a password pasted in the wrong place.
- Idempotent: `redact_text(redact_text(t)) == redact_text(t)`.
"""

from __future__ import annotations

import logging
import re

__all__ = ["MASK", "redact_url", "redact_text", "RedactingFilter"]

MASK = "***"

_URL_HEAD = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)(.*)", re.S)
# query parameters whose value is a secret: password, passwd, pwd, token, secret, *key*, auth*, sig*, credential*
_SECRET_PARAM = re.compile(r"(?i)([?&;][^=&;#?]*?(?:pass|pwd|token|secret|key|auth|sig|credential)[^=&;#?]*=)([^&;#]*)")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
_KV_PASSWORD = re.compile(r"(?i)\b(password|passwd|pwd)(\s*=\s*)('[^']*'|\"[^\"]*\"|[^\s,;&]+)")


def redact_url(url: str) -> str:
    """`url` with its user-info and secret query values replaced by `***` (see the module's invariants)."""
    m = _URL_HEAD.fullmatch(url)
    if m is None:
        head, sep, _ = url.partition(":")
        return f"{head}:{MASK}" if sep else url
    scheme, rest = m.groups()
    if "@" in rest:  # the last '@' ends the user-info, so a password holding '@', '/' or '?' is hidden whole
        userinfo, rest = rest.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        rest = (f"{user}:{MASK}" if has_password and user else MASK) + "@" + rest
    return scheme + _SECRET_PARAM.sub(lambda q: q.group(1) + MASK, rest)


def redact_text(text: str) -> str:
    """`text` with every URL in it redacted by `redact_url`, and `password=...` pairs (libpq DSNs) masked."""
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    return _KV_PASSWORD.sub(lambda m: m.group(1) + m.group(2) + MASK, text)


class RedactingFilter(logging.Filter):
    """A handler filter: the record's message (and its traceback) with credentials redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True
