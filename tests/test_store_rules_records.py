"""Every imported or stored record is validated before use: typed rules refuse odd designs, shapes, features and
tunables on every write and import (naming file:line); records already stored that break them (an older kernel-kb,
a hand) are skipped by `kb generate` with one warning, reported by `kb doctor`, and quarantined by `--fix`; a kernel
whose id is not its content hash is refused on import and flagged by doctor."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import text

from kb.errors import KBError
from kb.settings import Settings, load_settings
from kb.store import Kernel, Lesson, PerfRecord, Tunable, open_kb
from kb.store.records import assign_id
from kb.store.rules import violations
from tests.support.repo import KB_CLI, REPO, subprocess_env
from tests.support.store import edit_export, make_kernel, make_measured, make_source, make_tunable

DESIGN = {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3, "num_splits": 1, "tma": True, "pack_gqa": False}


def _kb(home: Path, *args: str, tmp: Path | None = None) -> subprocess.CompletedProcess:
    env = subprocess_env(**({"TMPDIR": str(tmp)} if tmp else {}))
    return subprocess.run([*KB_CLI, "--home", str(home), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def _measured(kernel_id: str, design: object = DESIGN, shape: object = None) -> PerfRecord:
    rec = make_measured(kernel_id)
    rec.arch, rec.design_json = "sm90", json.dumps(design)
    rec.shape_json = json.dumps({"B": 1, "Hq": 8, "Hkv": 8, "M": 4096, "N": 4096, "D": 64} if shape is None else shape)
    return rec


# -- the typed rules, on every write

@pytest.mark.parametrize("design,shape,why", [
    ({**DESIGN, "block_m": 100}, None, "blocks are powers of two in [16, 256]"),
    ({**DESIGN, "tma": "yes"}, None, "tma, pack_gqa, dq_swap and q_split true or false"),
    ({**DESIGN, "num_warps": 2**70}, None, "warps a power of two <= 16"),
    ({"block_m": 128, "block_n": 64}, None, "missing ['num_warps', 'num_stages']"),
    ({**DESIGN, "swizzle": 8}, None, "unknown keys ['swizzle']"),
    ([128, 64], None, "design_json is a JSON list, not an object"),
    (DESIGN, [1, 8, 4096, 64], "shape_json is a JSON list, not an object"),
    (DESIGN, {"D": "64"}, "D is '64', not a positive int"),
    (DESIGN, {"D": 0}, "D is 0, not a positive int"),
])
def test_an_odd_measured_design_is_refused(kb, design: object, shape: object, why: str) -> None:
    kid = kb.write_kernel(make_kernel(0))
    with pytest.raises(KBError, match="invalid PerfRecord") as caught:
        kb.write_perf([_measured(kid, design, shape)])
    assert why in str(caught.value)
    assert kb.list(PerfRecord) == []


def test_typed_features_params_and_identity() -> None:
    lesson = Lesson(kind="fix", text="t", features_json=json.dumps({"gqa_ratio": "4", "mask": "diagonal", "causal": 1}))
    assert violations(lesson) == ["features_json holds typed features (gqa_ratio is '4', not an int in [1, 65536]; "
                                  "mask is 'diagonal', not one of ['none', 'causal', 'sliding_window', 'document', "
                                  "'prefix_lm', 'block_sparse', 'custom']; causal is 1, not a bool)"]
    tunable = make_tunable(0)
    tunable.params_json = json.dumps({"block_m": -64, "num_warps": True, "block_n": "kBlockN"})  # a name is allowed
    assert violations(tunable) == ["params_json holds typed launch parameters (block_m is -64, not an int in [1, 4096] "
                                   "or a name; num_warps is True, not an int in [1, 4096] or a name)"]
    kernel = make_kernel(0)
    kernel.content_hash, kernel.id = "", "k-0123456789abcdef"
    assign_id(kernel)
    assert violations(kernel) == ["id is k- + the first 16 hex digits of content_hash"]
    spanned = assign_id(make_kernel(1))
    spanned.line_start, spanned.line_end = 1, 2**64
    assert violations(spanned) == ["line_end fits a signed 64-bit integer"]


# -- on import: refused whole, with file:line

def _export_with(tmp_path: Path, embedder, damage) -> Path:
    with open_kb(load_settings(home=tmp_path / "src"), embedder=embedder) as kb:
        kid = kb.write_kernel(make_kernel(0, kb.write_source(make_source())))
        kb.write_perf([_measured(kid)])
        kb.export_jsonl(tmp_path / "kb.jsonl")
    return edit_export(tmp_path / "kb.jsonl", damage)


def _line_of(path: Path, table: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if f'"table": "{table}"' in line)


def test_kb_import_refuses_an_odd_design_naming_file_and_line(tmp_path: Path, embedder) -> None:
    def odd(records: list[dict]) -> list[dict]:
        perf = next(r for r in records if r["table"] == "perf_records")["data"]
        perf["design_json"] = json.dumps({**DESIGN, "block_m": 100, "tma": "yes"})
        perf["shape_json"] = "[1, 8, 4096, 64]"
        return records

    dump = _export_with(tmp_path, embedder, odd)
    res = _kb(tmp_path / "kb", "import", str(dump))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"kb: error: {dump}:{_line_of(dump, 'perf_records')}: invalid PerfRecord p-")
    assert "shape_json is a JSON list, not an object" in line and "blocks are powers of two" in line
    assert json.loads(_kb(tmp_path / "kb", "stats", "--json").stdout)["rows"]["kernels"] == 0  # nothing of it


def test_kb_import_refuses_a_kernel_whose_id_is_not_its_content_hash(tmp_path: Path, embedder) -> None:
    def forged(records: list[dict]) -> list[dict]:
        kernel = next(r for r in records if r["table"] == "kernels")["data"]
        kernel["ir_text"] += "# something else\n"
        kernel["content_hash"] = hashlib.sha256(kernel["ir_text"].encode()).hexdigest()
        return [r for r in records if r["table"] in ("sources", "kernels")]  # the id stays the old program's

    dump = _export_with(tmp_path, embedder, forged)
    res = _kb(tmp_path / "kb", "import", str(dump))
    assert res.returncode == 1, res.stdout
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"kb: error: {dump}:{_line_of(dump, 'kernels')}: invalid Kernel k-")
    assert line.endswith("id is k- + the first 16 hex digits of content_hash")


# -- already stored: never fatal to generation, reported and quarantined by doctor

def _store_odd_records(settings: Settings) -> list[str]:
    """What an older kernel-kb (or a hand) could have stored: measured designs no rule of today accepts."""
    con = sqlite3.connect(settings.home / "kb.sqlite")
    kid = con.execute("SELECT id FROM kernels WHERE ir_text LIKE 'program %' ORDER BY id LIMIT 1").fetchone()[0]
    ids = []
    rows = [(DESIGN, {"D": 64}), ({**DESIGN, "tma": "yes"}, {"D": 64}), ({**DESIGN, "block_m": 100}, {"D": 128}),
            (DESIGN, [1, 8, 4096, 64])]
    for n, (design, shape) in enumerate(rows):
        ids.append(f"p-odd{n:013d}")
        con.execute("INSERT INTO perf_records (id, kernel_id, kind, gpu, driver, torch_version, triton_version, "
                    "shape_json, dtype, ms, tflops, command, measured_at, citation, notes, arch, design_json, quarantine) "
                    "VALUES (?, ?, 'measured', 'NVIDIA H200', '570', '2.11', '3.6', ?, 'bf16', ?, NULL, 'kb tune', "
                    "'2026-01-02 00:00:00', '', '', 'sm90', ?, '')",
                    (ids[-1], kid, json.dumps(shape), 1.0 + n, json.dumps(design)))
    con.commit()
    con.close()
    return ids[1:]  # the first one is valid


def test_stored_odd_records_never_stop_generation(ingested_kb_settings: Settings, tmp_path: Path) -> None:
    home = ingested_kb_settings.home
    odd = _store_odd_records(ingested_kb_settings)
    spec = tmp_path / "[" / "oops]" / "causal_d64.py"  # its path holds `[/oops]`, which rich must print as text
    spec.parent.mkdir(parents=True)
    shutil.copy(REPO / "examples/specs/causal_d64.py", spec)
    (tmp_path / "tmp").mkdir()

    gen = _kb(home, "generate", str(spec), "--no-verify", "--no-backward", "--out", str(tmp_path / "out"),
              tmp=tmp_path / "tmp")
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert f"{spec}: kernel k-" in gen.stdout and "[/oops]" in gen.stdout
    warnings = [line for line in gen.stderr.splitlines() if "break the KB's rules" in line]
    assert len(warnings) == 1 and "skipped 3 stored record(s)" in warnings[0], gen.stderr
    assert all(i in warnings[0] or "more" in warnings[0] for i in odd[:3])
    con = sqlite3.connect(home / "kb.sqlite")
    assert [s for (s,) in con.execute("SELECT status FROM generation_runs")] == ["succeeded"]  # none left running

    found = _kb(home, "doctor", "--json", tmp=tmp_path / "tmp")
    assert found.returncode == 1
    issues = json.loads(found.stdout)["issues"]
    assert {(i["kind"], i["id"]) for i in issues} == {("invalid_record", i) for i in odd}
    fixed = _kb(home, "doctor", "--fix", tmp=tmp_path / "tmp")
    assert fixed.returncode == 0 and "fixed: 3 invalid record" in fixed.stdout, fixed.stdout
    again = _kb(home, "doctor", tmp=tmp_path / "tmp")
    assert again.returncode == 0 and again.stdout.startswith("no issues") and "perf_records 3" in again.stdout
    assert "quarantine: invalid_record: design_json" in _kb(home, "show", odd[0]).stdout


def test_quarantined_rows_are_left_out_without_a_warning(kb, caplog) -> None:
    kid = kb.write_kernel(make_kernel(0))
    kb.write_perf([_measured(kid)])
    with kb.engines.write.begin() as conn:
        conn.execute(text("UPDATE perf_records SET design_json = :d"), {"d": json.dumps({**DESIGN, "tma": "yes"})})
    with caplog.at_level(logging.WARNING, logger="kb.store.kb"):
        assert kb.usable(PerfRecord) == [] and kb.usable(PerfRecord) == []
    assert len(caplog.records) == 1  # once per record per process
    kb.doctor(fix=True)
    caplog.clear()
    assert kb.usable(PerfRecord) == [] and not caplog.records
    assert len(kb.list(PerfRecord)) == 1  # kept, set aside
    assert kb.usable(Tunable) == [] and kb.usable(Kernel) == [kb.get(kid)]


def test_doctor_flags_a_stored_kernel_whose_id_is_not_its_content_hash(kb, tmp_path: Path) -> None:
    kid = kb.write_kernel(make_kernel(0))
    with kb.engines.write.begin() as conn:  # a copy stored under an id that names another program
        conn.execute(text("INSERT INTO kernels SELECT 'k-00000000deadbeef', name, family, origin, ir_text, content_hash, "
                          "features_json, arch, dtype, head_dim, source_id, file, line_start, line_end, lifter_version, "
                          "verified, verify_note, parent_id, spec_hash, triton_src, cuda_src, created_at, quarantine "
                          "FROM kernels WHERE id = :id"), {"id": kid})
    report = kb.doctor()
    ((kind, table, id_),) = {(d.kind.value, d.table, d.id) for d in report.issues if d.kind.value != "missing_embedding"}
    assert (kind, table, id_) == ("hash_mismatch", "kernels", "k-00000000deadbeef")
    kb.doctor(fix=True)
    assert kb.doctor().ok and kb.usable(Kernel) == [kb.get(kid)]
