"""`kb doctor` finds drift between SQL and Chroma, and `--fix` repairs it to zero (a kernel whose text no longer
hashes to its identity is quarantined: kept with its reason, never read again, its embedding removed)."""

from __future__ import annotations

from sqlalchemy import text

from kb.store import DriftKind
from tests.support.store import make_kernel, make_snippets


def test_detects_and_repairs_each_kind_of_drift(kb, embedder) -> None:
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
    assert fixed.fixed and len(fixed.issues) == len(report.issues) - 1  # the stale embedding left with its kernel
    after = kb.doctor()
    assert after.ok and after.quarantined == {"kernels": 1}
    aside = kb.get(ids[1])
    assert aside.quarantine.startswith("hash_mismatch: content_hash is sha256(ir_text)")
    assert kb.counts().vectors == {"kernels": 2, "snippets": 9, "lessons": 0}  # the quarantined kernel's is gone
    assert ids[1] not in [h[0] for h in kb.vector_query("kernels", aside.ir_text, k=3)]


def test_vector_query_drops_orphans(kb, embedder) -> None:
    kid = kb.write_kernel(make_kernel(0))
    doc = "program attn_0 exactly"
    kb.vectors.upsert("kernels", ["k-ghost00000000000"], embedder.embed([doc]), [doc], [{"doc_hash": "x"}])
    assert [h[0] for h in kb.vector_query("kernels", doc, k=5)] == [kid]
