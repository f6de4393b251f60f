"""`kb tune --backward` without a GPU: backward designs planned from the backward kernel, each timed as a training
step with its gradients checked (the interpreter's dry run), imported as the backward's performance memory, and
ranked first by later generations."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # the dry run interprets the candidate; set before triton is imported

import copy
import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import bench.gpu.tune_bwd as bwd
from generate.designs import design_table, rank_designs, sweeps_from_kb, tunable_rows
from generate.perf_import import import_results
from generate.pipeline import GenerateOptions, generate
from generate.tune import make_plan
from bench.gpu.tune_bwd import SCHEMA, run_plan_backward, summary_line
from generate.cuda_design import cuda_pairs, forward_dispatch
from kb.errors import KBError
from kb.features import Features
from kb.ir.design import Design, head_bucket, parse_design
from kb.settings import load_settings
from kb.store import Kernel, Lesson, PerfRecord, open_kb
from tests.support.generate_fixtures import H200_ENV, QUICK
from tests.support.ingested import private_copy
from tests.support.repo import KB_CLI, REPO

pytestmark = pytest.mark.network  # the session KB ingests the real flash-attn release

SPEC = REPO / "tests" / "data" / "specs_tune" / "causal_small_bf16.py"
ENV = {**H200_ENV, "command": "python -m bench.gpu.tune_bwd plan.json r.json", "date": "2026-12-05T12:00:00+00:00"}


@pytest.fixture(scope="module")
def _generated(ingested_home: Path, embedder, tmp_path_factory: pytest.TempPathFactory):
    """Generate (with a backward), plan the backward's designs and dry-run them once per module."""
    base = tmp_path_factory.mktemp("tuned_bwd")
    out = base / "out"
    with private_copy(ingested_home, base) as home, open_kb(load_settings(home=home), embedder=embedder) as kb:
        # the timer checks the gradients itself: verify_kernel=False keeps the verifier's backward mode out of it
        r = generate(kb, SPEC, GenerateOptions(out_dir=out, **{**QUICK, "backward": True, "verify_kernel": False}))
        assert r.succeeded and r.backward in ("verified", "generated, not verified"), r.backward_reason
        plan = make_plan(kb, [str(SPEC)], out, "sm90", max_designs=2, backward=True)
        doc = run_plan_backward(plan, base / "dry.json", device="cpu", trials=1)
    return home, out, r, plan, doc


@pytest.fixture
def tuned(_generated, embedder, tmp_path: Path) -> Iterator:
    """A private copy of the generated KB, so each test's import starts from the same state."""
    home, out, r, plan, doc = _generated
    shutil.copytree(home, tmp_path / "kb")
    with open_kb(load_settings(home=tmp_path / "kb"), embedder=embedder) as kb:
        yield kb, out, r, plan, copy.deepcopy(doc)


def _backward_id(out: Path) -> str:
    return json.loads((out / "gen_causal_small_bf16.report.json").read_text())["backward"]["kernel_id"]


def test_the_plan_times_the_backward_kernels_designs(tuned) -> None:
    kb, out, r, plan, _ = tuned
    (entry,) = plan["entries"]
    assert plan["backward"] and entry["backward"]
    assert entry["kernel"]["id"] == _backward_id(out) != r.kernel_id
    assert Features.from_json(entry["kernel"]["features_json"]).backward
    designs = [parse_design(d) for d in entry["designs"]]
    assert len(designs) == 2 and not any(d.tma for d in designs)  # the backward lowering uses no tensor descriptors


def test_each_design_is_a_checked_training_step(tuned) -> None:
    _, _, _, plan, doc = tuned
    assert doc["schema"] == SCHEMA
    (shape,) = doc["entries"][0]["shapes"]
    recs = {rec["impl"]: rec for rec in shape["records"]}
    assert recs["emitted"]["status"] == "ok", recs["emitted"]
    for text in plan["entries"][0]["designs"]:
        rec = recs[f"design {text}"]
        assert rec["status"] == "ok" and rec["design"] == text, rec
        assert set(rec["grad_err"]) == {"q", "k", "v"} and max(rec["grad_err"].values()) < 2e-2


def test_a_design_the_module_did_not_run_is_never_timed(tuned, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A design the GPU cannot run makes the module fall back to another; its time must not be recorded as the
    design's."""
    _, _, _, plan, _ = tuned
    entry = {**plan["entries"][0], "designs": plan["entries"][0]["designs"][:1]}
    real = bwd._backward_design

    def falls_back(module, design):
        return real(module, (*design[:3], design[3] * 2, *design[4:]))

    monkeypatch.setattr(bwd, "_backward_design", falls_back)
    doc = run_plan_backward({**plan, "entries": [entry]}, tmp_path / "r.json", device="cpu", trials=1)
    (rec,) = [r for r in doc["entries"][0]["shapes"][0]["records"] if r["impl"].startswith("design ")]
    assert rec["status"] == "does_not_fit" and "ms" not in rec


def test_a_candidate_swept_at_two_shapes_runs_its_designs_at_both(tuned, tmp_path: Path) -> None:
    """A plan sweeps one candidate once per head-dim bucket: the second entry must pin the designs of the module whose
    operator runs (the first import registered it), not of a second import that nothing calls."""
    _, _, _, plan, _ = tuned
    entry = {**plan["entries"][0], "designs": plan["entries"][0]["designs"][:1]}
    doc = run_plan_backward({**plan, "entries": [entry, {**entry, "name": entry["name"] + "_again"}]},
                            tmp_path / "r.json", device="cpu", trials=1)
    for done in doc["entries"]:
        (rec,) = [r for r in done["shapes"][0]["records"] if r["impl"].startswith("design ")]
        assert rec["status"] == "ok", (done["name"], rec)


def test_imported_backward_sweeps_rank_backward_designs_only(tuned) -> None:
    kb, out, r, plan, doc = tuned
    measured = dict(doc, env=ENV)
    recs = measured["entries"][0]["shapes"][0]["records"]
    designs = [rec for rec in recs if rec["impl"].startswith("design ")]
    designs[-1]["ms"] = designs[0]["ms"] / 3  # the design listed last measured fastest
    s = import_results(kb, measured, "bwd.json")
    bid = _backward_id(out)
    assert s.kernels_added == 0 and s.perf_records == 3 and s.lessons == 1
    rows = kb.list(PerfRecord, kernel_id=bid)
    assert {p.arch for p in rows} == {"sm90"} and not kb.list(PerfRecord, kernel_id=r.kernel_id)
    assert all("training step" in p.notes for p in rows)
    assert any("as emitted by kb generate (ModelNew training step, backward design " in p.notes for p in rows)
    (lesson,) = [les for les in kb.list(Lesson) if les.kind == "perf_design"]
    assert "backward design" in lesson.text and "per training step" in lesson.text

    winner = parse_design(designs[-1]["design"])
    sweeps = sweeps_from_kb(kb, "sm90")
    assert [s.features.backward for s in sweeps] == [True]
    feats = Features.from_json(kb.get(bid).features_json)
    target = replace(feats, arch="sm90")
    assert rank_designs(target, "sm90", 32, sweeps, tunable_rows(kb))[0] == winner
    assert rank_designs(replace(target, backward=False), "sm90", 32, sweeps, tunable_rows(kb))[0] != winner
    table = design_table(kb, target, ["sm90", "sm80"], [32])
    assert table["sm90"][32][0] == winner
    assert table["sm80"] == design_table(kb, target, ["sm80"], [32], memory=False)["sm80"]  # memory is per arch


def test_a_sweep_and_its_kernel_must_agree_on_the_direction(tuned) -> None:
    kb, _, r, _, doc = tuned
    forward = kb.get(r.kernel_id)
    assert isinstance(forward, Kernel)
    wrong = dict(copy.deepcopy(doc), env=ENV)
    wrong["entries"][0]["kernel"] = {f: getattr(forward, f) for f in ("id", "name", "ir_text", "features_json")}
    before = len(kb.list(PerfRecord))
    with pytest.raises(KBError, match="a training-step sweep whose kernel .* is not a backward program"):
        import_results(kb, wrong, "bwd.json")
    as_forward = dict(copy.deepcopy(doc), env=ENV, schema="kernel-kb/tune/v1")
    with pytest.raises(KBError, match="a forward sweep whose kernel .* is a backward program"):
        import_results(kb, as_forward, "fwd.json")
    assert len(kb.list(PerfRecord)) == before


def test_kb_tune_backward_plan_from_the_cli(tuned, tmp_path: Path) -> None:
    kb, out, _, _, _ = tuned
    env = {"KB_HOME": str(kb.settings.home), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    plan = tmp_path / "plan.json"
    res = subprocess.run([*KB_CLI, "tune", "--backward", str(SPEC), "--from", str(out), "--plan", str(plan),
                          "--target", "sm90", "--max-designs", "3"], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "python -m bench.gpu.tune_bwd" in res.stdout
    doc = json.loads(plan.read_text())
    assert doc["backward"] and [len(e["designs"]) for e in doc["entries"]] == [3]
    assert all(isinstance(parse_design(d), Design) for d in doc["entries"][0]["designs"])
    fwd_only = tmp_path / "fwd"
    shutil.copytree(out, fwd_only)
    report = fwd_only / "gen_causal_small_bf16.report.json"
    report.write_text(json.dumps({**json.loads(report.read_text()), "backward": {"status": "none", "reason": "why"}}))
    res = subprocess.run([*KB_CLI, "tune", "--backward", str(SPEC), "--from", str(fwd_only), "--plan", str(plan)],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith("kb: error: ") and "has no backward to tune (none: why)" in res.stderr


def test_the_summary_line_names_the_best_design(tuned) -> None:
    _, _, _, _, doc = tuned
    line = summary_line(doc["entries"][0], 1.0)
    assert "2/2 backward designs ran, best " in line and "x emitted)" in line and "flex" not in line


def test_a_measured_hopper_backward_imports_as_the_backward_kernels_cu_pair(tuned) -> None:
    """bench.gpu.tune_bwd's `emitted-cuda-bwd` (the training step with the `.cu`'s Hopper backward) imports as a `.cu`
    record of the backward kernel, never a design; generation then lists the Hopper backward only where it measured
    faster (generate.cuda_design.with_backward reads the backward kernels' pairs, the forward's dispatch the others)."""
    kb, out, r, _, doc = tuned
    measured = dict(doc, env=ENV)
    shape = measured["entries"][0]["shapes"][0]
    triton_ms = next(rec["ms"] for rec in shape["records"] if rec["impl"] == "emitted")
    shape["records"].append({"impl": "emitted-cuda-bwd", "status": "ok", "ms": triton_ms / 0.8, "tflops": 1.0,
                             "lowering": "sm90_wgmma"})
    import_results(kb, measured, "bwd.json")
    assert all(s.times for s in sweeps_from_kb(kb, "sm90"))  # not read as a backward design
    (pair,) = cuda_pairs(kb, "sm90", "sm90_wgmma")
    assert pair.kernel_id == _backward_id(out) and pair.features.backward and pair.speedup == pytest.approx(0.8)
    notes = [p.notes for p in kb.list(PerfRecord, kernel_id=pair.kernel_id) if "kb_launch_bwd" in p.notes]
    assert len(notes) == 1 and "training step" in notes[0]
    runs, why = forward_dispatch([pair], pair.features, head_bucket(shape["shape"]["D"]), pair.kernel_id)
    assert not runs and "0.80x" in why
