"""`kb ingest --all` on the real pinned corpus: what lands in the KB, coverage, idempotency, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kb.features import Features
from kb.store.models import Kernel, Snippet
from tests.support.generate_fixtures import INGEST_SUMMARY
from tests.support.repo import KB_CLI, REPO, TEST_CACHE

pytestmark = pytest.mark.network
REQUIRED_KINDS = {"mask_causal", "mask_local", "alibi", "softcap", "dropout", "split_kv_combine", "paged_kv", "gqa", "varlen"}


def test_corpus_coverage(ingested_kb) -> None:
    kernels = ingested_kb.list(Kernel)
    snippets = ingested_kb.list(Snippet)
    triton = [k for k in kernels if k.family.startswith("fa2_triton") and k.verified]
    assert len(triton) >= 3, [k.name for k in kernels]
    fa2 = [k for k in kernels if k.family == "fa2_cuda" and k.ir_text.startswith("program ")]
    assert fa2 and all(k.verified for k in fa2), "the FA2-derived reference program is verified by the interpreter"
    assert any(Features.from_json(k.features_json).split_kv for k in triton), "a split-KV decode program"
    assert len(snippets) >= 40 and REQUIRED_KINDS <= {s.kind for s in snippets}
    # provenance: every kernel and snippet points into a pinned release
    assert all(k.source_id and k.file and k.line_start for k in kernels)
    assert all(s.source_id and s.file and s.line_start and s.line_end >= s.line_start for s in snippets)
    totals = INGEST_SUMMARY["all"].totals()
    assert totals["programs"] == len([k for k in kernels]) or totals["programs"] >= len(triton)


def _run(args: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")} | {
        "KB_HOME": str(home), "KB_CACHE_DIR": str(TEST_CACHE), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*KB_CLI, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_reingest_is_a_noop_and_bad_sources_change_nothing(ingested_home: Path, tmp_path: Path) -> None:
    home = tmp_path / "kb"
    shutil.copytree(ingested_home, home)
    before = _run(["stats", "--json"], home).stdout
    again = _run(["ingest", "nvidia-cutlass", "--json"], home)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["totals"]["new_rows"] == 0
    for bad in (["ingest", "no-such-corpus"], ["ingest", "pypi:flash-attn"], ["ingest", str(tmp_path / "missing")]):
        res = _run(bad, home)
        assert res.returncode == 1 and "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert _run(["stats", "--json"], home).stdout == before
