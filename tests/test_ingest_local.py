"""`kb ingest PATH` on a user's own files: one source row per path and content, every file read in the coverage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ingest.run import ingest
from kb.errors import KBError
from kb.store.models import Snippet, Source

SOFTCAP = "template <typename T>\n__device__ void apply_softcap(T &t, float softcap) { t = tanhf(t * softcap); }\n"


def _tree(root: Path) -> Path:
    root.mkdir()
    (root / "my_softcap.cuh").write_text(SOFTCAP)
    (root / "helpers.py").write_text("import torch\n\ndef scale(x):\n    return x * 2\n")
    (root / "notes.txt").write_text("not read\n")
    return root


def _files(summary) -> dict[str, tuple[tuple[str, str], ...]]:
    return {f.file: f.skipped for s in summary.sources for f in s.files}


def test_each_path_and_content_is_its_own_source_row(kb, tmp_path: Path) -> None:
    root = _tree(tmp_path / "mine")
    first = ingest(kb, [str(root)], progress=False)
    (src1,) = kb.list(Source)
    assert src1.kind == "local" and src1.filename == str(root.resolve()) and len(src1.sha256) == 64
    assert first.totals()["new_rows"] >= 1
    (snip,) = [s for s in kb.list(Snippet) if s.kind == "softcap"]
    assert snip.source_id == src1.id

    again = ingest(kb, [str(root)], progress=False)  # unchanged content: a no-op, the row keeps its time
    assert again.totals()["new_rows"] == 0
    (same,) = kb.list(Source)
    assert same.id == src1.id and same.fetched_at == src1.fetched_at

    (root / "my_softcap.cuh").write_text(SOFTCAP + "// tuned\n")
    ingest(kb, [str(root)], progress=False)
    ingest(kb, [str(root / "my_softcap.cuh")], progress=False)  # one file of it: another path, another row
    rows = kb.list(Source)
    assert len(rows) == 3 and len({r.sha256 for r in rows}) == 3
    assert kb.get(snip.id).source_id == src1.id  # earlier rows still point at the source they were read from
    assert len({s.source_id for s in kb.list(Snippet) if s.kind == "softcap"}) == 3


def test_every_file_read_is_in_the_coverage(kb, tmp_path: Path) -> None:
    root = _tree(tmp_path / "mine")
    files = _files(ingest(kb, [str(root)], progress=False))
    assert set(files) == {"my_softcap.cuh", "helpers.py"}  # .txt is not read
    assert files["helpers.py"] == (("file", "no Triton kernel (no @triton.jit function and no import of triton)"),)


def test_nothing_found_is_an_error_before_any_write(kb, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.md").write_text("# nothing\n")
    with pytest.raises(KBError, match=r"no kernels found \(no \.py or CUDA/C\+\+ file in it\)"):
        ingest(kb, [str(empty)], progress=False)
    (empty / "util.py").write_text("def f():\n    pass\n")
    with pytest.raises(KBError, match=r"no kernels found \(read 1 file"):
        ingest(kb, [str(empty)], progress=False)
    assert kb.list(Source) == []


def test_cli_nothing_found_is_one_line_and_exit_1(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")} | {"KB_HOME": str(tmp_path / "kb")}
    res = subprocess.run([sys.executable, "-m", "cli.main", "ingest", str(empty)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "no kernels found" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
