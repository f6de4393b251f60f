"""What the tests using the session KB share (the fixtures themselves live in conftest.py)."""

from __future__ import annotations

__all__ = ["INGEST_SUMMARY", "QUICK", "H200_ENV"]

INGEST_SUMMARY: dict = {}  # the IngestSummary of the session KB (filled by conftest's ingested_home), for coverage tests

# quick verification in generation tests (one distribution, the spec's own shape), forward only: the backward
# stage has its own tests (test_generate_backward.py); `kb generate` runs the full harness and the backward
QUICK = dict(verify_distributions=("normal",), verify_max_cases=1, compile_cuda=False, backward=False)

# the `env` a results document from the H200 carries (what `kb perf import` requires); tests put it on CPU dry runs
# to exercise the import, which is never done with real results of a dry run
H200_ENV = {"gpu": "NVIDIA H200", "arch": "sm90", "sms": 132, "driver": "580.159.04", "torch_version": "2.11.0+cu130",
            "triton_version": "3.6.0", "cuda": "13.0", "command": "python -m bench.gpu.tune plan.json r.json",
            "date": "2026-12-03T12:00:00+00:00"}
