"""Every table survives export -> import into a fresh KB; writes are idempotent by content hash."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kb.errors import KBError
from kb.settings import load_settings
from kb.store import GenerationRun, Kernel, open_kb
from tests.support.store import (
    make_kernel,
    make_measured,
    make_reported,
    make_run_records,
    make_snippets,
    make_source,
    make_tunable,
)


def _fill(kb) -> str:
    src = kb.write_source(make_source())
    kid = kb.write_kernel(make_kernel(0, src), snippets=make_snippets(0, src), tunables=[make_tunable(0, src)])
    child = make_kernel(1, src)
    child.parent_id, child.origin = kid, "generated"
    cid = kb.write_kernel(child, perf=[make_measured(""), make_reported("")])
    run, attempt, lesson = make_run_records(cid)
    kb.write_run(run)
    kb.write_attempt(attempt)
    kb.write_lesson(lesson)
    return cid


def _records(path: Path) -> list[str]:
    return sorted(path.read_text().splitlines()[1:])  # line 1 is the header with its timestamp


def test_every_table_round_trips(kb, tmp_path: Path, embedder) -> None:
    _fill(kb)
    first = tmp_path / "a.jsonl"
    counts = kb.export_jsonl(first)
    assert all(n >= 1 for n in counts.values()), counts

    with open_kb(load_settings(home=tmp_path / "other"), embedder=embedder) as fresh:
        assert fresh.import_jsonl(first) == counts
        second = tmp_path / "b.jsonl"
        fresh.export_jsonl(second)
        assert _records(first) == _records(second)
        assert fresh.counts().rows == kb.counts().rows
        assert fresh.counts().vectors == {"kernels": 2, "snippets": 3, "lessons": 1}
        assert fresh.doctor().ok
        assert fresh.vector_query("lessons", "alibi slope per head", k=1)[0][0].startswith("l-")
        # Importing again changes nothing.
        fresh.import_jsonl(first)
        assert fresh.counts().rows == kb.counts().rows


def test_rows_equal_field_by_field_after_import(kb, tmp_path: Path, embedder) -> None:
    cid = _fill(kb)
    kb.export_jsonl(tmp_path / "a.jsonl")
    with open_kb(load_settings(home=tmp_path / "other"), embedder=embedder) as fresh:
        fresh.import_jsonl(tmp_path / "a.jsonl")
        original = kb.get(cid)
        copy = fresh.get(cid)
        assert copy.model_dump() == original.model_dump()
        assert [k.id for k in fresh.lineage(cid)] == [cid, original.parent_id]


def test_same_kernel_twice_is_one_row(kb) -> None:
    src = kb.write_source(make_source())
    a = kb.write_kernel(make_kernel(7, src), snippets=make_snippets(7, src))
    b = kb.write_kernel(make_kernel(7, src), snippets=make_snippets(7, src))
    assert a == b
    assert kb.counts().rows["kernels"] == 1
    assert kb.counts().rows["snippets"] == 3
    assert kb.counts().vectors["kernels"] == 1


def test_rewrite_does_not_reembed_unchanged_rows(kb_settings, embedder) -> None:
    calls: list[int] = []

    class Counting:
        name = embedder.name

        def embed(self, texts):
            calls.append(len(texts))
            return embedder.embed(texts)

    with open_kb(kb_settings, embedder=Counting()) as kb:
        kb.write_kernel(make_kernel(3), snippets=make_snippets(3))
        assert sum(calls) == 4
        kb.write_kernel(make_kernel(3), snippets=make_snippets(3))
        assert sum(calls) == 4  # same documents: Chroma already holds them
        changed = make_kernel(3)
        changed.verified, changed.verify_note = True, "passed interpreter check"
        kb.write_kernel(changed)
        assert kb.get(changed.id).verified
        assert sum(calls) == 5  # verified is in the metadata, so the kernel is re-upserted


def test_kernel_id_is_content_hash(kb) -> None:
    k = make_kernel(5)
    kid = kb.write_kernel(k)
    assert kid == "k-" + hashlib.sha256(k.ir_text.encode()).hexdigest()[:16]
    assert kb.get(kid).content_hash == hashlib.sha256(k.ir_text.encode()).hexdigest()


def test_get_row_reads_one_table(kb) -> None:
    kid = kb.write_kernel(make_kernel(6))
    assert kb.get_row(Kernel, kid) == kb.get(kid)
    with pytest.raises(KBError, match="is a Kernel, not a GenerationRun"):
        kb.get_row(GenerationRun, kid)


def test_list_kernels_filters(kb) -> None:
    for i in range(6):
        kb.write_kernel(make_kernel(i))
    sm90 = kb.list_kernels(arch="sm90")
    assert {k.name for k in sm90} == {"attn_1", "attn_4"}
    assert {k.name for k in kb.list_kernels(arch="sm90", head_dim=128)} == {"attn_1"}
    hits = kb.vector_query("kernels", "sliding_window mask", k=3, where={"arch": "sm90", "head_dim": 128})
    assert [h[0] for h in hits] == [sm90[0].id if sm90[0].head_dim == 128 else sm90[1].id]


def test_export_lines_are_tagged_json(kb, tmp_path: Path) -> None:
    _fill(kb)
    kb.export_jsonl(tmp_path / "x.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert lines[0]["table"] == "kb_meta" and lines[0]["data"]["format"] == "kernel-kb-export"
    tables = [line["table"] for line in lines[1:]]
    assert tables.index("sources") < tables.index("kernels") < tables.index("snippets")
    kernels = [line["data"] for line in lines if line["table"] == "kernels"]
    assert kernels[0]["parent_id"] is None and kernels[1]["parent_id"] == kernels[0]["id"]
    assert isinstance(Kernel.model_validate(kernels[1]), Kernel)
