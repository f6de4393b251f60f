"""Constants shared by the tests that use the session KB (the fixtures themselves live in conftest.py)."""

from __future__ import annotations

from tests.conftest import INGEST_SUMMARY, REPO, TEST_CACHE

__all__ = ["INGEST_SUMMARY", "REPO", "TEST_CACHE"]
