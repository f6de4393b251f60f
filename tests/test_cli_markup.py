"""Text from the KB is text: a kernel named `[/oops]` (rich's closing-tag syntax) prints as itself in `kb query`,
`show`, `stats`, `doctor` and `tune`'s table instead of crashing rich (`kb generate`: tests/test_store_rules_records.py)."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

from rich.console import Console
from sqlalchemy import text

from cli.app import esc
from cli.tune import results_table
from kb.settings import load_settings
from kb.store import open_kb
from tests.support.repo import KB_CLI, REPO, subprocess_env
from tests.support.store import make_kernel

ODD = "[/oops]"


def _kb(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KB_CLI, "--home", str(home), *args], cwd=REPO, env=subprocess_env(TMPDIR=str(home.parent)),
                          capture_output=True, text=True, timeout=300)


def test_kb_text_with_markup_prints_as_text(tmp_path: Path, embedder) -> None:
    home = tmp_path / "kb"
    with open_kb(load_settings(home=home), embedder=embedder) as kb:
        odd = make_kernel(0)
        odd.name, odd.family = ODD, "[bold]fa2"
        kid = kb.write_kernel(odd)
        kb.write_kernel(make_kernel(1))
        with kb.engines.write.begin() as conn:  # a stored lesson whose broken rule quotes the odd text back
            conn.execute(text("INSERT INTO lessons (id, run_id, kind, text, features_json, created_at, quarantine) "
                              "VALUES ('l-odd', NULL, :k, 'x', :f, '2026-01-01 00:00:00', '')"),
                         {"k": ODD, "f": json.dumps({"mask": ODD})})

    query = _kb(home, "query", f"{ODD} causal attention", "-k", "2")
    assert query.returncode == 0, query.stderr[-2000:]
    assert f"query: {ODD} causal attention" in query.stdout and ODD in query.stdout and "[bold]fa2" in query.stdout
    show = _kb(home, "show", kid)
    assert show.returncode == 0 and f"name: {ODD}" in show.stdout and "family: [bold]fa2" in show.stdout
    assert _kb(home, "stats").returncode == 0
    doctor = _kb(home, "doctor")
    assert doctor.returncode == 1 and f"mask is '{ODD}'" in doctor.stdout, doctor.stderr
    for res in (query, show, doctor):
        assert "MarkupError" not in res.stderr and "Traceback" not in res.stderr


def test_tune_table_and_esc() -> None:
    doc = {"env": {"gpu": "H200 [/oops]", "arch": "sm90"}, "entries": [{"name": ODD, "shapes": [{
        "shape": {"B": 1, "Hq": 8, "Hkv": 8, "M": 128, "N": 128, "D": 64}, "emitted_design": "[/x]",
        "records": [{"impl": "emitted", "status": "ok", "ms": 1.0},
                    {"impl": "design 128x64 w4 s3", "design": "[red]128x64", "status": "ok", "ms": 0.5}]}]}]}
    buf = io.StringIO()
    Console(file=buf, width=300).print(results_table(doc))
    assert ODD in buf.getvalue() and "H200 [/oops]" in buf.getvalue() and "[red]128x64" in buf.getvalue()
    assert esc("[/oops]") != "[/oops]" and Console(file=io.StringIO()).render_str(esc("[/oops]")).plain == "[/oops]"
