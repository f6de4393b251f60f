"""Bad records are refused with one KBError naming the broken rules; nothing half-written."""

from __future__ import annotations

from datetime import datetime

import pytest

from kb.errors import KBError
from kb.store import Kernel, PerfRecord, Snippet
from kb.store.rules import violations
from tests.support.store import make_kernel, make_measured, make_reported, make_snippets


def test_measured_needs_provenance() -> None:
    bad = make_measured("k-1")
    bad.gpu, bad.command = "", ""
    assert violations(bad) == ["a measured record needs gpu, ms, command and measured_at"]


def test_measured_and_citation_never_mixed() -> None:
    both = make_measured("k-1")
    both.citation = "paper"
    assert "a measured record has no citation" in violations(both)
    rep = make_reported("k-1")
    rep.command = "python bench.py"
    assert any("reported record has no measurement" in v for v in violations(rep))
    assert violations(make_reported("k-1")) == []


def test_reported_needs_citation() -> None:
    assert "a reported record needs a citation" in violations(PerfRecord(kernel_id="k-1", kind="reported", tflops=3.0))


def test_unknown_kind_and_naive_datetime() -> None:
    p = make_measured("k-1")
    p.kind = "guessed"
    p.measured_at = datetime(2026, 1, 1)
    v = violations(p)
    assert any(x.startswith("kind is one of") for x in v)
    assert "measured_at is timezone-aware (use datetime.now(UTC))" in v


def test_kernel_with_wrong_hash_is_refused(kb) -> None:
    k = make_kernel(1)
    k.content_hash = "0" * 64
    with pytest.raises(KBError, match="content_hash is sha256"):
        kb.write_kernel(k)
    assert kb.counts().rows["kernels"] == 0


def test_bad_snippet_rolls_back_whole_kernel(kb) -> None:
    snippets = make_snippets(2) + [Snippet(kind="mask", features_json="[1]", text="x")]
    with pytest.raises(KBError, match="features_json is a JSON list, not an object"):
        kb.write_kernel(make_kernel(2), snippets=snippets)
    assert kb.counts().rows["kernels"] == 0 and kb.counts().rows["snippets"] == 0


def test_dangling_reference_is_a_kb_error_and_rolls_back(kb) -> None:
    k = make_kernel(3, source_id="src-doesnotexist0000")
    with pytest.raises(KBError, match="write rejected"):
        kb.write_kernel(k, snippets=make_snippets(3))
    assert sum(kb.counts().rows.values()) == 0
    assert sum(kb.counts().vectors.values()) == 0


def test_perf_kernel_id_defaults_to_its_kernel(kb) -> None:
    kid = kb.write_kernel(make_kernel(4), perf=[make_measured(""), make_reported("")])
    assert {p.kernel_id for p in kb.list(PerfRecord)} == {kid}


def test_unknown_id_raises(kb) -> None:
    with pytest.raises(KBError, match="no record with id 'k-0000'"):
        kb.get("k-0000")
    assert kb.find("zz-unknown") is None


def test_kernel_requires_ir_text(kb) -> None:
    with pytest.raises(KBError, match="ir_text is required"):
        kb.write_kernel(Kernel(ir_text=""))
