"""`kb doctor` finds drift between SQL and Chroma, and `--fix` repairs it to zero."""

from __future__ import annotations

from sqlalchemy import text

from kb.store import DriftKind
from kb.store.doctor import HASH_NOTE
from tests.support.store import make_kernel, make_snippets


def test_detects_and_repairs_each_kind_of_drift(kb, embedder) -> None:  # noqa: ANN001
    ids = [kb.write_kernel(make_kernel(i), snippets=make_snippets(i)) for i in range(3)]
    assert kb.doctor().ok

    kb.vectors.delete("kernels", [ids[0]])  # a row without its embedding
    kb.vectors.upsert("snippets", ["s-orphan000000000"], embedder.embed(["orphan"]), ["orphan"], [{"doc_hash": "x"}])
    with kb.engines.write.begin() as conn:  # the stored text changes under its hash
        conn.execute(text("UPDATE kernels SET ir_text = ir_text || '# tampered', verified = 1 WHERE id = :id"), {"id": ids[1]})

    report = kb.doctor()
    found = {(d.kind, d.id) for d in report.issues}
    assert (DriftKind.MISSING_EMBEDDING, ids[0]) in found
    assert (DriftKind.ORPHAN_EMBEDDING, "s-orphan000000000") in found
    assert (DriftKind.HASH_MISMATCH, ids[1]) in found
    assert (DriftKind.STALE_EMBEDDING, ids[1]) in found  # its embedded document changed too
    assert not report.ok and not report.fixed

    fixed = kb.doctor(fix=True)
    assert fixed.fixed and len(fixed.issues) == len(report.issues)
    assert kb.doctor().ok
    repaired = kb.get(ids[1])
    assert not repaired.verified and repaired.verify_note == HASH_NOTE
    assert kb.counts().vectors == {"kernels": 3, "snippets": 9, "lessons": 0}
    assert kb.vector_query("kernels", repaired.ir_text, k=1)[0][0] == ids[1]


def test_vector_query_drops_orphans(kb, embedder) -> None:  # noqa: ANN001
    kid = kb.write_kernel(make_kernel(0))
    doc = "program attn_0 exactly"
    kb.vectors.upsert("kernels", ["k-ghost00000000000"], embedder.embed([doc]), [doc], [{"doc_hash": "x"}])
    assert [h[0] for h in kb.vector_query("kernels", doc, k=5)] == [kid]
