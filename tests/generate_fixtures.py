"""Constants shared by the tests that use the session KB (the fixtures themselves live in conftest.py)."""

from __future__ import annotations

from tests.conftest import INGEST_SUMMARY, REPO, TEST_CACHE

__all__ = ["INGEST_SUMMARY", "REPO", "TEST_CACHE"]

# quick verification in generation tests (one distribution, the spec's own shape), forward only: the backward
# stage has its own tests (test_generate_backward.py); `kb generate` runs the full harness and the backward
QUICK = dict(verify_distributions=("normal",), verify_max_cases=1, compile_cuda=False, backward=False)
