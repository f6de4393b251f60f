"""What the tests using the session KB share (the fixtures themselves live in conftest.py)."""

from __future__ import annotations

__all__ = ["INGEST_SUMMARY", "QUICK"]

INGEST_SUMMARY: dict = {}  # the IngestSummary of the session KB (filled by conftest's ingested_home), for coverage tests

# quick verification in generation tests (one distribution, the spec's own shape), forward only: the backward
# stage has its own tests (test_generate_backward.py); `kb generate` runs the full harness and the backward
QUICK = dict(verify_distributions=("normal",), verify_max_cases=1, compile_cuda=False, backward=False)
