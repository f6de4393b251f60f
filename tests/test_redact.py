"""`kb.redact`: user-info and secret query values leave URLs, in settings, free text and log records."""

from __future__ import annotations

import logging

import pytest

from kb.redact import RedactingFilter, redact_text, redact_url
from kb.settings import Settings


@pytest.mark.parametrize("url,shown", [
    ("postgresql://kb:s3cret@db:5432/kernels", "postgresql://kb:***@db:5432/kernels"),
    ("postgresql+psycopg2://kb@db/kernels", "postgresql+psycopg2://***@db/kernels"),  # a lone user may be a token
    ("http://u:pa@ss/w?rd@llm:8000/v1", "http://u:***@llm:8000/v1"),  # the last '@' ends the user-info
    ("http://:s3cret@h/", "http://***@h/"),
    ("http://llm:8000/v1?api_key=s3cret&model=m", "http://llm:8000/v1?api_key=***&model=m"),
    ("postgresql://db/k?sslmode=require&password=s3cret", "postgresql://db/k?sslmode=require&password=***"),
    ("https://h/x?X-Amz-Signature=s3cret&access_token=s3cret", "https://h/x?X-Amz-Signature=***&access_token=***"),
    ("sqlite:////home/me/kb.sqlite", "sqlite:////home/me/kb.sqlite"),
    ("http://chroma:8000", "http://chroma:8000"),
    ("kb:s3cret", "kb:***"),  # not scheme://...: only what precedes the first ':'
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_url(shown) == shown  # idempotent


def test_redact_text_finds_every_url_and_dsn_password() -> None:
    msg = ("cannot connect to http://me:s3cret@llm:1/v1 (Connection refused); fell back from 'postgresql://kb:s3cret@db/k'; "
           "dsn host=db password=s3cret user=kb")
    clean = redact_text(msg)
    assert "s3cret" not in clean
    assert "http://me:***@llm:1/v1 (Connection refused)" in clean and "'postgresql://kb:***@db/k'" in clean
    assert "password=*** user=kb" in clean and redact_text(clean) == clean


def test_log_records_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("tests.redact")
    caplog.handler.addFilter(RedactingFilter())
    with caplog.at_level(logging.INFO, logger="tests.redact"):
        log.info("HTTP Request: POST %s %r", "http://u:s3cret@llm/v1/chat/completions", 200)
        try:
            raise RuntimeError("cannot reach http://u:s3cret@llm/v1")
        except RuntimeError:
            log.exception("request failed")
    assert "s3cret" not in caplog.text and "http://u:***@llm/v1/chat/completions" in caplog.text
    assert "RuntimeError: cannot reach http://u:***@llm/v1" in caplog.text


def test_settings_repr_hides_credentials() -> None:
    s = Settings(db_url="postgresql://kb:s3cret@db/k", chroma_url="http://c:s3cret@chroma:8000",
                 llm_base_url="http://u:s3cret@llm/v1", llm_api_key="sk-s3cret")
    assert "s3cret" not in repr(s) and "llm_api_key='***'" in repr(s) and "kb:***@db/k" in repr(s)
