"""Write-back never rewrites history, and `--out` always holds one consistent set of files per spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import text

import generate.pipeline as pipeline
from generate.pipeline import GenerateOptions, generate
from kb.errors import KBError
from kb.settings import load_settings
from kb.store import Kernel, open_kb
from tests.support.generate_fixtures import QUICK
from tests.support.repo import REPO
from tests.support.store import export_without_snippets, make_kernel, make_source

pytestmark = pytest.mark.network  # the session KB ingests the real flash-attn release

SPEC = REPO / "examples" / "specs" / "sliding_window.py"


def _stem_files(out: Path) -> set[str]:
    return {p.name for p in out.iterdir() if not p.name.startswith(".")}


def test_regeneration_keeps_lineage_and_the_kb_round_trips(ingested_kb, embedder, tmp_path: Path) -> None:
    kb = ingested_kb
    first = generate(kb, SPEC, GenerateOptions(out_dir=tmp_path / "a", **QUICK))
    assert first.succeeded, first.error
    born = kb.get(first.kernel_id)
    assert kb.get(born.parent_id).origin == "ingest"
    for n in range(1):  # memory on: the second run retrieves the first one's kernel as its reference
        again = generate(kb, SPEC, GenerateOptions(out_dir=tmp_path / f"b{n}", **QUICK))
        assert again.succeeded and again.kernel_id == first.kernel_id, again.error
        report = json.loads(again.files["report"].read_text())
        assert report["kernel_was_in_kb"] and report["status"] == "verified"
    now = kb.get(first.kernel_id)
    assert (now.parent_id, now.file, now.created_at) == (born.parent_id, born.file, born.created_at)
    assert kb.doctor().ok
    export_without_snippets(kb, tmp_path / "kb.jsonl")  # the lineage is what travels here
    with open_kb(load_settings(home=tmp_path / "fresh"), embedder=embedder) as fresh:
        counts = fresh.import_jsonl(tmp_path / "kb.jsonl")
        assert counts["kernels"] == len(kb.list_kernels()) == len(fresh.list_kernels())
        assert fresh.get(first.kernel_id).parent_id == born.parent_id
        assert fresh.doctor().ok


def test_rewriting_a_kernel_never_changes_its_provenance(kb) -> None:
    src = kb.write_source(make_source())
    parent = kb.write_kernel(make_kernel(1, src))
    child = make_kernel(2, src)
    child.parent_id = parent
    kid = kb.write_kernel(child)
    again = make_kernel(2, src)
    again.parent_id, again.file, again.verified = None, "elsewhere.py", True
    kb.write_kernel(again)
    row = kb.get(kid)
    assert (row.parent_id, row.file, row.verified) == (parent, "k2.py", True)  # only verification may be upgraded


def test_export_refuses_a_lineage_cycle_and_leaves_no_file(kb, tmp_path: Path) -> None:
    src = kb.write_source(make_source())
    a, b = kb.write_kernel(make_kernel(1, src)), kb.write_kernel(make_kernel(2, src))
    with kb.engines.write.begin() as con:  # damage made by an older kernel-kb, written behind the store's back
        con.execute(text("UPDATE kernels SET parent_id = :p WHERE id = :k"), [{"p": b, "k": a}, {"p": a, "k": b}])
    with pytest.raises(KBError, match="lineage has a cycle.*kb doctor --fix"):
        kb.export_jsonl(tmp_path / "x.jsonl")
    assert not list(tmp_path.glob("x.jsonl*"))


def test_out_dir_holds_one_consistent_set(ingested_kb, tmp_path: Path) -> None:
    out = tmp_path / "out"
    ok = generate(ingested_kb, SPEC, GenerateOptions(out_dir=out, **QUICK))
    assert ok.succeeded and _stem_files(out) == {"gen_sliding_window.py", "gen_sliding_window_triton.py",
                                                 "gen_sliding_window.kbir", "gen_sliding_window.cu",
                                                 "gen_sliding_window.report.json"}
    # a later failing run with the same stem: its report says so, and no older candidate remains beside it
    bad = tmp_path / "sliding_window.py"
    bad.write_text((REPO / "tests/data/specs_bad/op_after_softmax.py").read_text())
    failed = generate(ingested_kb, bad, GenerateOptions(out_dir=out, **QUICK))
    assert not failed.succeeded
    assert _stem_files(out) == {"gen_sliding_window.report.json"}
    report = json.loads((out / "gen_sliding_window.report.json").read_text())
    assert report["status"] == "failed" and report["error"] and report["kernel_id"] is None


def test_unverified_kernels_say_so(ingested_kb, tmp_path: Path) -> None:
    r = generate(ingested_kb, SPEC, GenerateOptions(out_dir=tmp_path, verify_kernel=False, compile_cuda=False))
    assert r.succeeded and r.status == "generated, not verified"
    assert json.loads(r.files["report"].read_text())["status"] == "generated, not verified"
    k = ingested_kb.get(r.kernel_id)
    assert isinstance(k, Kernel) and not k.verified


def test_an_interrupted_run_publishes_nothing(ingested_kb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "gen_sliding_window.py").write_text("# an older run's candidate\n")

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "_verify", stop)
    with pytest.raises(KeyboardInterrupt):
        generate(ingested_kb, SPEC, GenerateOptions(out_dir=out, **QUICK))
    assert [p.name for p in out.iterdir()] == ["gen_sliding_window.py"]  # untouched, no staging left behind
