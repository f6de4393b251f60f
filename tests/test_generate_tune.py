"""`kb tune` without a GPU: the plan, the dry run of the GPU half, and the write-back of measurements."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # the dry run interprets the candidate; set before triton is imported

import copy
import json
import shutil
import subprocess
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from generate.perf_import import _lesson, import_results, load_results
from generate.pipeline import GenerateOptions, generate
from generate.tune import make_plan
from bench.gpu.tune import SCHEMA, module_call, run_plan
from generate.cuda_design import cuda_pairs, forward_dispatch
from generate.designs import sweeps_from_kb
from kb.errors import KBError
from kb.features import Features
from kb.ir.design import head_bucket, parse_design
from kb.settings import load_settings
from kb.store import Lesson, PerfRecord, open_kb
from tests.support.generate_fixtures import H200_ENV, QUICK
from tests.support.ingested import private_copy
from tests.support.repo import KB_CLI, REPO

pytestmark = pytest.mark.network  # the session KB ingests the real flash-attn release

SPEC = REPO / "bench" / "tuning" / "causal.py"
ENV = H200_ENV


@pytest.fixture(scope="module")
def _generated(ingested_home: Path, embedder, tmp_path_factory: pytest.TempPathFactory):
    """Generate, plan and dry-run once per module (the slow part); tests get copies of the KB it leaves."""
    base = tmp_path_factory.mktemp("tuned")
    out = base / "out"
    with private_copy(ingested_home, base) as home, open_kb(load_settings(home=home), embedder=embedder) as kb:
        r = generate(kb, SPEC, GenerateOptions(out_dir=out, **QUICK))
        assert r.succeeded, r.error
        plan = make_plan(kb, [str(SPEC)], out, "sm90", max_designs=1)
        doc = run_plan(plan, base / "dry.json", device="cpu")
    return home, r, plan, doc


@pytest.fixture
def tuned(_generated, embedder, tmp_path: Path) -> Iterator:
    """A private copy of the generated KB, so each test's import starts from the same state."""
    home, r, plan, doc = _generated
    shutil.copytree(home, tmp_path / "kb")
    with open_kb(load_settings(home=tmp_path / "kb"), embedder=embedder) as kb:
        yield kb, r, plan, copy.deepcopy(doc)


def test_plan_lists_designs_per_bench_shape_in_both_orders(tuned) -> None:
    _, r, plan, doc = tuned
    assert [e["name"] for e in plan["entries"]] == ["causal_d64", "causal_d128"]
    for e in plan["entries"]:
        assert e["kernel"]["id"] == r.kernel_id and e["candidate"].endswith("gen_causal.py")
        assert e["designs"] and all(parse_design(d) for d in e["designs"])
        assert e["order_memory"] and e["order_no_memory"]
    recs = {rec["impl"]: rec for rec in doc["entries"][0]["shapes"][0]["records"]}
    assert recs["emitted"]["status"] == "ok" and recs["emitted"]["max_abs_err"] < 2e-2
    assert all(rec["status"] == "ok" for name, rec in recs.items() if name.startswith("design "))


def test_measurements_import_as_records_and_a_lesson_once(tuned, tmp_path: Path) -> None:
    kb, r, _, doc = tuned
    measured = dict(doc, env=ENV)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(measured))
    s = import_results(kb, load_results(path), str(path))
    assert s.kernels_added == 0 and s.perf_records >= 2 and s.lessons == 2
    rows = kb.list(PerfRecord, kernel_id=r.kernel_id)
    designed = [p for p in rows if p.design_json != "{}"]
    assert designed and all(p.arch == "sm90" and p.kind == "measured" and p.gpu == "NVIDIA H200" for p in rows)
    assert any("as emitted by kb generate" in p.notes for p in rows)
    assert any(les.kind == "perf_design" and "NVIDIA H200 (sm90)" in les.text for les in kb.list(Lesson))
    again = import_results(kb, load_results(path), str(path))
    assert len(kb.list(PerfRecord, kernel_id=r.kernel_id)) == len(rows) and again.perf_records == s.perf_records


def test_a_lesson_names_the_head_dim_that_was_timed() -> None:
    shape = {"shape": {"B": 1, "Hq": 2, "Hkv": 2, "M": 64, "N": 64, "D": 128},
             "records": [{"impl": "design 64x64 w4 s3", "status": "ok", "ms": 1.0, "design": "64x64 w4 s3"}]}
    lesson = _lesson(Features(mask="causal", head_dim=64), ENV, shape, backward=False)
    assert lesson is not None and "head dim 128 " in lesson.text and "head dim 64" not in lesson.text


@pytest.mark.parametrize("damage, message", [
    (lambda d: d["env"].pop("gpu"), "unattributed measurements: env lacks gpu"),
    (lambda d: d["env"].update(date="yesterday"), "is not an ISO date"),
    (lambda d: d.update(schema="other"), "not a kernel-kb tune results file"),
    (lambda d: d["entries"][0]["shapes"][0]["records"][-1].update(impl="design huge", design="huge"), "bad design"),
    (lambda d: d["entries"][0].pop("kernel"), "no kernel record"),
    (lambda d: d["entries"][0]["shapes"][0]["shape"].update(D="64"),  # a rule of the store, named with its entry
     r"results: entry 1 \(.*\): a PerfRecord that breaks the KB's rules: shape_json .*D is '64', not a positive int"),
    (lambda d: d["entries"][0]["shapes"][0].update(records="oops"), r"entry 1 \(.*\): malformed \(TypeError: string indices"),
])
def test_malformed_or_unattributed_results_are_refused_whole(tuned, damage, message) -> None:
    kb, r, _, doc = tuned
    bad = copy.deepcopy(dict(doc, env=dict(ENV)))
    bad["entries"][0]["shapes"][0]["records"][-1].update(status="ok", ms=1.0)
    damage(bad)
    before = len(kb.list(PerfRecord))
    with pytest.raises(KBError, match=message):
        import_results(kb, bad)
    assert len(kb.list(PerfRecord)) == before


def test_a_dry_run_is_never_imported(tuned) -> None:
    kb, _, _, doc = tuned
    assert doc["schema"] == SCHEMA
    with pytest.raises(KBError, match="unattributed"):
        import_results(kb, doc)


def test_kb_tune_says_it_needs_a_gpu(ingested_kb_settings, tmp_path: Path) -> None:
    env = {"KB_HOME": str(ingested_kb_settings.home), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([*KB_CLI, "tune", str(SPEC), "--from", str(tmp_path)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().startswith("kb: error: kb tune needs a CUDA GPU") and "--plan" in res.stderr


def test_measured_cu_records_decide_where_the_cu_runs(tuned) -> None:
    """kb tune's `emitted-cuda` timing imports as a `.cu` record (never a Triton design); the module runs the `.cu`
    where it was measured faster than the Triton module of the same run, for the same lowering and arch: the kernel's
    own records first, else those of kernels like it."""
    kb, r, _, doc = tuned
    measured = json.loads(json.dumps(dict(doc, env={**ENV, "date": "2026-12-04T12:00:00+00:00"})))  # a run of its own
    measured["entries"] = measured["entries"][:1]  # the CPU dry run times both entries at one small shape
    shape = measured["entries"][0]["shapes"][0]
    triton_ms = next(rec["ms"] for rec in shape["records"] if rec["impl"] == "emitted")
    shape["records"].append({"impl": "emitted-cuda", "status": "ok", "ms": triton_ms / 1.25, "tflops": 1.0,
                             "lowering": "sm90_wgmma"})
    import_results(kb, measured, "synthetic")
    assert all(s.times for s in sweeps_from_kb(kb, "sm90"))  # the .cu record is not read as a design
    (pair,) = cuda_pairs(kb, "sm90", "sm90_wgmma")
    assert pair.kernel_id == r.kernel_id and pair.speedup == pytest.approx(1.25)
    assert cuda_pairs(kb, "sm90", "tensor_cores") == [] and cuda_pairs(kb, "sm80", "sm90_wgmma") == []
    features = Features.from_json(kb.get(r.kernel_id).features_json)
    bucket = head_bucket(shape["shape"]["D"])
    runs, why = forward_dispatch([pair], features, bucket, r.kernel_id)
    assert runs and "1.25x the Triton module" in why and "NVIDIA H200" in why
    assert forward_dispatch([pair], features, bucket, "k-another")[0]  # a kernel like it follows the measurement
    slower = replace(pair, kernel_id="k-another", cuda_ms=pair.triton_ms * 1.05)
    assert not forward_dispatch([pair, slower], features, bucket, "k-another")[0]  # its own record decides
    assert not forward_dispatch([pair], features, bucket * 2, r.kernel_id)[0]  # never measured at this head dim
    assert not forward_dispatch([], features, bucket)[0]
    # a kernel unlike every measured one (a decode against a prefill's pair) runs Triton, whatever the pair says
    unlike = replace(features, decode=True, split_kv=True, mask="document")
    runs, why = forward_dispatch([pair], unlike, bucket, "k-another")
    assert not runs and "no kernel alike" in why


def test_the_bench_learns_forward_arguments_when_the_cu_answers_the_call() -> None:
    """A module that dispatches to its `.cu` never calls forward(): the bench takes the arguments from the dispatch
    (run 17 lost four held-out specs to an IndexError there) and says which implementation ran."""
    src = (
        "import torch\n"
        "def forward(q, k, v, *, sm_scale=None, **aux):\n    return (q + 1, None)\n"
        "def _cuda_forward(q, k, v, sm_scale, named):\n    return (q * 2, None) if CU else None\n"
        "class ModelNew(torch.nn.Module):\n"
        "    def forward(self, q, k, v):\n"
        "        out = _cuda_forward(q, k, v, 0.5, {'bias': v})\n"
        "        return (out if out is not None else forward(q, k, v, sm_scale=0.5, bias=v))[0]\n")
    for cu, runs in ((True, ".cu"), (False, "triton")):
        cand = types.ModuleType("cand")
        exec(compile(src, "cand.py", "exec"), cand.__dict__)
        cand.CU = cu
        q, k, v = (torch.full((1, 1, 2, 4), float(i)) for i in (1, 2, 3))
        args, kwargs, out, ran = module_call(cand, cand.ModelNew(), [q, k, v])
        assert ran == runs and len(args) == 3 and all(a is b for a, b in zip(args, (q, k, v)))
        assert kwargs["sm_scale"] == 0.5 and kwargs["bias"] is v
        assert torch.equal(out, q * 2 if cu else q + 1)
