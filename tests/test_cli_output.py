"""`kb` in scripts and pipes: --version, whole ids and paths when stdout is not a terminal, failures on stderr,
`kb generate --json`, and a spec path that does not exist as an error rather than a free-text query."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import out
from cli.main import app
from cli.tune import results_table
from cli.work import _print_generated
from generate.pipeline import GenerateResult
from generate.stages import ReportStatus
from kb.settings import load_settings
from kb.store import Kernel, open_kb
from tests.support.repo import KB_CLI, REPO, subprocess_env
from tests.support.store import make_kernel, make_snippets, make_source

runner = CliRunner()  # its stdout is not a terminal, as a pipe's
NARROW = "40"  # COLUMNS of a terminal beside the pipe: tables used to be cut to it
REFUSED_SPEC = REPO / "tests" / "data" / "specs_refused" / "dense_sinks.py"  # refused before any attempt
LONG_DIR = "a_directory_with_a_rather_long_name/and_one_more_level_below_it"


def _kb(home: Path, *args: str) -> subprocess.CompletedProcess:
    """`kb ARGS` as a script runs it: stdout and stderr are pipes."""
    return subprocess.run([*KB_CLI, "--home", str(home), *args], env=subprocess_env(COLUMNS=NARROW), cwd=REPO,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def filled(tmp_path: Path, embedder) -> tuple[Path, list[str]]:
    home = tmp_path / "kb"
    with open_kb(load_settings(home=home), embedder=embedder) as kb:
        src = kb.write_source(make_source())
        ids = [kb.write_kernel(make_kernel(i, src), snippets=make_snippets(i, src)) for i in range(4)]
    return home, ids


def test_version_comes_from_the_package_metadata() -> None:
    res = subprocess.run([*KB_CLI, "--version"], env=subprocess_env(), cwd=REPO, capture_output=True, text=True)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert res.returncode == 0 and res.stdout == f"kernel-kb {version}\n", res.stderr


def test_tables_in_a_pipe_keep_whole_ids_and_paths(filled, tmp_path: Path) -> None:
    home, ids = filled
    mine = tmp_path / "mine"
    (mine / LONG_DIR).mkdir(parents=True)
    (mine / LONG_DIR / "my_softcap.cuh").write_text(
        "template <typename T>\n__device__ void apply_softcap(T &t, float softcap) { t = tanhf(t * softcap); }\n")

    ingested = _kb(home, "ingest", str(mine))
    assert ingested.returncode == 0, ingested.stderr
    assert any(f"│ {LONG_DIR}/my_softcap.cuh │" in line for line in ingested.stdout.splitlines()), ingested.stdout

    found = _kb(home, "query", "sliding window mask", "-k", str(len(ids)))
    assert found.returncode == 0, found.stderr
    rows = [line for line in found.stdout.splitlines() if line.startswith("│ ") and "k-" in line]
    assert sorted(line.split("│")[2].strip() for line in rows) == sorted(ids)  # one row each, every id whole
    assert "…" not in ingested.stdout + found.stdout


def test_every_command_prints_whole_ids_when_not_a_terminal(filled, embedder, capsys: pytest.CaptureFixture[str]) -> None:
    home, ids = filled
    env = {"COLUMNS": NARROW}
    shown = runner.invoke(app, ["--home", str(home), "show", ids[0]], env=env)
    assert shown.exit_code == 0 and f"Kernel {ids[0]}" in shown.stdout
    assert "provenance: synthetic-attn==1.0 (local) k0.py:1-5 lifter t1" in shown.stdout  # one line, not folded
    with open_kb(load_settings(home=home), embedder=embedder) as kb:
        kb.vectors.delete("kernels", [ids[1]])
    doctor = runner.invoke(app, ["--home", str(home), "doctor"], env=env)
    assert doctor.exit_code == 1 and any(ids[1] in line and "missing_embedding" in line for line in doctor.stdout.splitlines())
    stats = runner.invoke(app, ["--home", str(home), "stats"], env=env)
    assert stats.exit_code == 0 and any("perf_records" in line for line in stats.stdout.splitlines())

    # kb tune's and kb bench's table (timing needs a GPU; the table is the same code)
    name = "a_spec_with_a_name_longer_than_any_terminal_column_would_allow"
    doc = {"env": {"gpu": "NVIDIA H200", "arch": "sm90"}, "entries": [{"name": name, "shapes": [{
        "shape": {"B": 1, "Hq": 8, "Hkv": 8, "M": 1024, "N": 1024, "D": 128}, "emitted_design": "m128 n64 w4 s3",
        "records": [{"impl": "emitted", "ms": 1.0}, {"impl": "design m128 n64 w4 s3", "status": "ok", "ms": 0.9,
                                                       "design": "m128 n64 w4 s3"}, {"impl": "flex", "ms": 1.5}]}]}]}
    capsys.readouterr()
    out.print(results_table(doc))
    assert any(name in line and "m128 n64 w4 s3" in line for line in capsys.readouterr().out.splitlines())

    # kb generate's table of what it made (a real run: test_generate_json_reports_what_it_published)
    cand = Path("/an/output/directory/with/a/long/name") / f"gen_{name}.py"
    made = GenerateResult(Path(f"specs/{name}.py"), "r-0", True, ids[0], (), {"candidate": cand,
                          "triton": cand.with_name(f"gen_{name}_triton.py")}, status=ReportStatus.VERIFIED)
    _print_generated([made])
    lines = capsys.readouterr().out.splitlines()
    assert any(f"specs/{name}.py" in line and ids[0] in line and str(cand) in line for line in lines)
    assert f"specs/{name}.py: kernel {ids[0]} -> {cand} (Triton: gen_{name}_triton.py)" in lines


def test_verify_prints_its_table_through_the_same_console(tmp_path: Path) -> None:
    spec, cheat = REPO / "tests/support/verify_fixtures/attn_spec.py", REPO / "tests/cheats/calls_sdpa.py"
    res = runner.invoke(app, ["--home", str(tmp_path / "kb"), "verify", str(spec), str(cheat)], env={"COLUMNS": NARROW})
    assert res.exit_code == 1 and "forbidden_call" in res.stdout
    assert any(line.split("│")[2].strip() == str(cheat) for line in res.stdout.splitlines() if "│ candidate" in line)


def test_generate_failures_go_to_stderr_and_json_to_stdout(kb, tmp_path: Path) -> None:
    args = ["--home", str(kb.settings.home), "generate", str(REFUSED_SPEC), "--out", str(tmp_path / "out")]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 1, res.output
    (spec,) = json.loads(res.stdout)["specs"]  # stdout is the JSON document and nothing else
    assert spec["spec"] == str(REFUSED_SPEC) and spec["status"] == "failed" and spec["kernel_id"] is None
    assert spec["attempts"] == 0 and "dense specs with attention sinks is not supported yet" in spec["error"]
    assert Path(spec["files"]["report"]).is_file() and spec["backward"] == {"status": "none", "reason": ""}
    assert res.stderr.startswith(f"{REFUSED_SPEC}: failed: generation for dense specs with attention sinks is not supported yet")

    plain = runner.invoke(app, args, env={"COLUMNS": NARROW})
    assert plain.exit_code == 1
    assert "not supported" not in plain.stdout and "not supported" in plain.stderr  # the reason is a failure
    assert plain.stdout.strip() == f"outputs in {tmp_path / 'out'} (each spec's .report.json says what its files are)"


def test_a_spec_path_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    for arg in ("some/missing_path", "missing_spec.py"):
        res = runner.invoke(app, ["--home", str(tmp_path / "kb"), "query", arg])
        assert res.exit_code == 1 and res.stdout == ""
        assert res.stderr.startswith(f"kb: error: spec file {arg} does not exist") and len(res.stderr.splitlines()) == 1
    res = runner.invoke(app, ["--home", str(tmp_path / "kb"), "query", str(tmp_path)])  # a directory is no spec either
    assert res.exit_code == 1 and f"kb: error: {tmp_path} is not a spec file" in res.stderr


@pytest.mark.network  # the session KB ingests the real corpus
def test_generate_json_reports_what_it_published(ingested_kb_settings, tmp_path: Path) -> None:
    spec = REPO / "examples" / "specs" / "sliding_window.py"
    res = runner.invoke(app, ["--home", str(ingested_kb_settings.home), "generate", str(spec), "--out", str(tmp_path / "out"),
                              "--no-verify", "--no-backward", "--json"])
    assert res.exit_code == 0, res.output
    (got,) = json.loads(res.stdout)["specs"]
    assert got["status"] == "generated, not verified" and got["kernel_id"].startswith("k-") and got["attempts"] >= 1
    assert {"candidate", "triton", "ir", "report"} <= set(got["files"]) and got["error"] == ""
    assert all(Path(p).is_file() for p in got["files"].values())
    report = json.loads(Path(got["files"]["report"]).read_text())
    assert report["status"] == got["status"] and report["kernel_id"] == got["kernel_id"]
    with open_kb(ingested_kb_settings) as kb:
        assert isinstance(kb.get(got["kernel_id"]), Kernel)
