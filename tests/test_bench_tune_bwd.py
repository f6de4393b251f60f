"""Timing the backward (`bench.gpu.tune_bwd`) and the backward held-out suite, without a GPU.

The GPU numbers come from the device machine; here: the new held-out spec keeps the held-out contract and
gives its table a gradient, the suite names issue #15's classes, the FLOP convention, the fp32 reference,
and the dry run of the timer on fake candidates (a correct one, a forward-only one, one whose backward
raises, one with a wrong gradient)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # the dry run's rule (candidates are Triton); set before triton is imported

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from bench.gpu.tune import PLAN_SCHEMA
from bench.gpu.tune_bwd import (GRAD_TOL, SCHEMA, fwd_bwd_flops, read_suite, reference_grads, rel_fro,
                                   run_plan_backward, suite_plan, summarize, summary_line)
from bench.gpu.tune_common import output_ok, write_results
from generate.pipeline import GenerateOptions, generate
from tests.support.generate_fixtures import QUICK

REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "bench" / "heldout"
LEARNED = HELDOUT / "relative_bias_learned.py"
CAUSAL = HELDOUT / "causal_d64.py"  # fp32 spec with SDPA = "causal": the dry run's SDPA record
ISSUE_15_CLASSES = {"causal", "sliding-window", "alibi", "softcap", "document-mask", "prefix-lm", "gqa",
                    "relative-bias-learnable"}


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- the new held-out spec -------------------------------------------------------------------------

def test_learned_relative_bias_meets_the_heldout_contract() -> None:
    check = _load(HELDOUT / "_check_specs.py", "heldout_check_specs")
    mod = check.load(LEARNED)
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs()).eval()
    inputs = mod.get_inputs()
    assert isinstance(model.rel_bias.weight, torch.nn.Parameter) and model.rel_bias.weight.requires_grad
    with torch.no_grad():
        out = model(*inputs)
        ref, has_mods = check.dense_reference(mod, inputs, model)
        plain = check.plain_attention(inputs, False, mod.SCALE)
    assert has_mods and out.dtype == torch.bfloat16 and mod.SDPA is None
    assert (out.float() - ref).abs().max() < 2e-2
    assert (plain - ref).abs().max() > 1e-2  # the bias matters at the small shape; plain SDPA is not it
    assert check.check_bench(mod) == "B8 H12/12 4096x4096 D64"


def test_bucket_is_an_exact_function_of_the_offset() -> None:
    """No integer offset sits within 0.016 of a log-bucket boundary, so fp32 and fp64 logs agree everywhere."""
    mod = _load(LEARNED, "heldout_rbl_bucket")
    rel = torch.arange(-8192, 8193, dtype=torch.int32)
    got = mod.relative_bucket(rel)
    dist = rel.abs().double()
    per_side, exact = mod.NUM_BUCKETS // 2, mod.NUM_BUCKETS // 4
    far = exact + torch.floor(torch.log(dist.clamp(min=1) / exact) / math.log(mod.MAX_DISTANCE / exact) * exact)
    want = (rel > 0).long() * per_side + torch.where(dist < exact, dist, far.clamp(max=per_side - 1)).long()
    assert torch.equal(got, want)
    assert got.min() == 0 and got.max() == mod.NUM_BUCKETS - 1


def test_the_learned_table_gets_the_reference_gradient() -> None:
    """The fp32 reference (dense, row chunks, from flex_mods) gives the spec Model's own autograd gradients,
    the table's included."""
    mod = _load(LEARNED, "heldout_rbl_grad")
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs())
    inputs = [t.float() for t in mod.get_inputs()]
    dout = torch.randn(2, 4, 203, 64)
    ref = reference_grads(mod, inputs, model, dout, chunk_elems=4 * 203 * 50)  # 5 row chunks per batch
    leaves = [t.clone().requires_grad_() for t in inputs]
    own = _load(LEARNED, "heldout_rbl_grad2").Model(*mod.get_init_inputs())
    own.load_state_dict(model.state_dict())
    own(*leaves).backward(dout)
    want = dict(zip("qkv", (t.grad for t in leaves)), **{"rel_bias.weight": own.rel_bias.weight.grad})
    assert set(ref.grads) == set(want)
    for name, g in want.items():
        assert rel_fro(ref.grads[name], g) < 1e-5, name
    assert ref.grads["rel_bias.weight"].abs().sum() > 0
    assert model.rel_bias.weight.grad is None  # the reference works on a copy


def test_reference_gives_zero_for_rows_that_see_no_key() -> None:
    spec = SimpleNamespace(flex_mods=lambda *ins: (None, lambda b, h, q, kv: (q > 0) & (kv <= q)), SCALE=None)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    ref = reference_grads(spec, [q, k, v], torch.nn.Module(), torch.randn(1, 2, 9, 8), chunk_elems=2 * 9 * 4)
    assert all(torch.isfinite(g).all() for g in ref.grads.values())
    assert ref.out[:, :, 0].abs().max() == 0 and ref.grads["q"][:, :, 0].abs().max() == 0


# ---- the suite ----------------------------------------------------------------------------------

def test_backward_suite_covers_issue_15_classes() -> None:
    rows = read_suite(HELDOUT / "backward_suite.txt")
    core = [r for r in rows if r.tier == "core"]
    assert {r.klass for r in core} == ISSUE_15_CLASSES and len(core) == len(ISSUE_15_CLASSES)
    assert {r.tier for r in rows} == {"core", "extra"}
    assert len({r.klass for r in rows}) == len(rows) and len({r.spec for r in rows}) == len(rows)  # one per class
    readme = (HELDOUT / "README.md").read_text().split("## Backward", 1)[1]
    for r in rows:
        assert r.spec.is_file(), r.spec
        assert f"`{r.spec.name}`" in readme, r.spec.name
        assert getattr(_load(r.spec, f"suite_{r.spec.stem}"), "BENCH")["M"] > 1, "decode has no backward to time"


def test_suite_plan_points_at_the_generated_candidates(tmp_path: Path) -> None:
    plan = suite_plan(HELDOUT / "backward_suite.txt", tmp_path)
    assert plan["schema"] == PLAN_SCHEMA and len(plan["entries"]) == 13
    e = next(x for x in plan["entries"] if x["name"] == "relative_bias_learned")
    assert e["candidate"] == str(tmp_path / "gen_relative_bias_learned.py")
    assert (e["tier"], e["class"], e["designs"], e["shapes"]) == ("core", "relative-bias-learnable", [], None)
    core = suite_plan(HELDOUT / "backward_suite.txt", tmp_path, tier="core")["entries"]
    assert len(core) == 8 and {x["tier"] for x in core} == {"core"}


# ---- FLOPs and errors -------------------------------------------------------------------------------

def test_flop_convention_is_4d_forward_10d_backward() -> None:
    assert fwd_bwd_flops(16, 128, 128, 1000) == (4 * 16 * 128 * 1000, 10 * 16 * 128 * 1000)
    f, b = fwd_bwd_flops(2, 64, 128, 10)  # D_v != D: S and dK/dQ with D, dV and dP with D_v
    assert (f, b) == (2 * 2 * 10 * (64 + 128), 2 * 2 * 10 * (3 * 64 + 2 * 128))


def test_relative_frobenius_error() -> None:
    ref = torch.tensor([3.0, 4.0])
    assert rel_fro(torch.tensor([3.0, 4.0]), ref) == 0
    assert rel_fro(torch.tensor([3.0, 9.0]), ref) == pytest.approx(1.0)
    assert rel_fro(torch.tensor([3.0, math.nan]), ref) == math.inf
    assert rel_fro(torch.zeros(3), ref) == math.inf
    assert rel_fro(torch.tensor([0.5]), torch.zeros(1)) == pytest.approx(0.5)


# ---- the dry run on fake candidates ---------------------------------------------------------------------

_HEAD = '''import importlib.util
import torch
_s = importlib.util.spec_from_file_location("fake_spec_{tag}", {spec!r})
_m = importlib.util.module_from_spec(_s)
_s.loader.exec_module(_m)
'''
_FAKES = {
    "good": "class ModelNew(_m.Model):\n    pass\n",
    "forward_only": ("class ModelNew(_m.Model):\n    def forward(self, *args):\n        with torch.no_grad():\n"
                     "            return super().forward(*args)\n"),
    "raises": ("class _NoBwd(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n        return x.clone()\n"
               "    @staticmethod\n    def backward(ctx, g):\n        raise NotImplementedError('backward kernel not generated')\n"
               "class ModelNew(_m.Model):\n    def forward(self, q, k, v):\n        return _NoBwd.apply(super().forward(q, k, v))\n"),
    "wrong_dv": ("class _Twice(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n        return x.clone()\n"
                 "    @staticmethod\n    def backward(ctx, g):\n        return 2 * g\n"
                 "class ModelNew(_m.Model):\n    def forward(self, q, k, v):\n        return super().forward(q, k, _Twice.apply(v))\n"),
    "bad_shape": "class ModelNew(_m.Model):\n    def forward(self, q, k, v):\n        return super().forward(q, k, v)[:, :, 1:]\n",
    "frozen_table": ("class ModelNew(_m.Model):\n    def forward(self, q, k, v):\n"
                     "        self.rel_bias.weight.requires_grad_(False)\n        return super().forward(q, k, v)\n"),
}


def _fake(tmp_path: Path, spec: Path, kind: str) -> str:
    path = tmp_path / f"fake_{spec.stem}_{kind}.py"
    path.write_text(_HEAD.format(tag=f"{spec.stem}_{kind}", spec=str(spec)) + _FAKES[kind])
    return str(path)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("bwd")
    cases = [(LEARNED, k) for k in ("good", "forward_only", "raises", "wrong_dv", "frozen_table", "bad_shape")] + [(CAUSAL, "good")]
    entries = [{"name": f"{s.stem}:{k}", "spec": str(s), "candidate": _fake(tmp, s, k), "designs": [], "tier": "core"}
               for s, k in cases]
    entries.append({"name": "missing", "spec": str(LEARNED), "candidate": str(tmp / "nope.py"), "designs": []})
    (tmp / "gen_refused.report.json").write_text(json.dumps({"status": "failed", "error": "float to integer cast"}))
    entries.append({"name": "refused", "spec": str(LEARNED), "candidate": str(tmp / "gen_refused.py"), "designs": []})
    lines: list[str] = []
    doc = run_plan_backward({"schema": PLAN_SCHEMA, "entries": entries}, tmp / "bwd.json", device="cpu",
                            on_entry=lambda e, s: lines.append(summary_line(e, s)))
    return {"doc": doc, "lines": lines, "file": json.loads((tmp / "bwd.json").read_text())}


def _records(dry_run: dict, name: str) -> dict:
    entry = next(e for e in dry_run["doc"]["entries"] if e["name"] == name)
    return {r["impl"]: r for r in entry["shapes"][0]["records"]}


def test_a_correct_candidate_is_checked_then_timed(dry_run: dict) -> None:
    em = _records(dry_run, "relative_bias_learned:good")["emitted"]
    assert em["status"] == "ok" and em["ms"] > 0 and em["tflops"] > 0 and "fwd_ms" in em
    assert set(em["grad_err"]) == {"q", "k", "v", "rel_bias.weight"}
    assert max(em["grad_err"].values()) < GRAD_TOL
    shape = next(e for e in dry_run["doc"]["entries"] if e["name"] == "relative_bias_learned:good")["shapes"][0]
    assert shape["learnable"] == ["rel_bias.weight"]
    assert shape["shape"]["flops"] == shape["shape"]["flops_fwd"] * 3.5  # D_v = D: 4D + 10D


def test_forward_only_and_raising_backwards_are_no_backward(dry_run: dict) -> None:
    fo = _records(dry_run, "relative_bias_learned:forward_only")["emitted"]
    assert fo["status"] == "no_backward" and "grad_fn" in fo["error"] and "ms" not in fo
    rb = _records(dry_run, "relative_bias_learned:raises")["emitted"]
    assert rb["status"] == "no_backward" and "backward kernel not generated" in rb["error"] and "ms" not in rb


def test_wrong_or_missing_gradients_are_mismatches_never_timed(dry_run: dict) -> None:
    wrong = _records(dry_run, "relative_bias_learned:wrong_dv")["emitted"]
    assert wrong["status"] == "mismatch" and "ms" not in wrong
    assert wrong["grad_err"]["v"] == pytest.approx(1.0, rel=0.05) and wrong["grad_err"]["q"] < GRAD_TOL
    frozen = _records(dry_run, "relative_bias_learned:frozen_table")["emitted"]
    assert frozen["status"] == "mismatch" and frozen["missing_grads"] == ["rel_bias.weight"]
    assert "no gradient for rel_bias.weight" in frozen["error"]
    bad = _records(dry_run, "relative_bias_learned:bad_shape")["emitted"]
    assert bad["status"] == "mismatch" and "output shape" in bad["error"] and "ms" not in bad


def test_sdpa_is_timed_where_it_applies_and_flex_says_why_not_on_cpu(dry_run: dict) -> None:
    recs = _records(dry_run, "causal_d64:good")
    assert recs["sdpa"]["status"] == "ok" and max(recs["sdpa"]["grad_err"].values()) < GRAD_TOL
    assert recs["flex"]["status"] == "n/a" and "CPU" in recs["flex"]["error"]
    assert _records(dry_run, "relative_bias_learned:good")["sdpa"]["status"] == "n/a"
    entry = next(e for e in dry_run["doc"]["entries"] if e["name"] == "causal_d64:good")
    assert entry["shapes"][0]["vs_sdpa"] > 0


def test_results_document_and_summary_lines(dry_run: dict) -> None:
    doc = dry_run["file"]
    assert doc["schema"] == SCHEMA and doc["env"]["dry_run"] == "cpu" and "10*D" in doc["flop_convention"]
    assert len(dry_run["lines"]) == len(doc["entries"]) == 9
    assert "no_backward" in dry_run["lines"][1] and "mismatch" in dry_run["lines"][3]
    missing = next(e for e in doc["entries"] if e["name"] == "missing")
    assert "kb generate" in missing["error"] and dry_run["lines"][-2].startswith("missing: ERROR")
    refused = next(e for e in doc["entries"] if e["name"] == "refused")
    assert refused["generate_status"] == "failed" and refused["error"] == "kb generate: failed: float to integer cast"
    assert (missing["tier"], missing["class"]) == ("core", "relative-bias-learnable")  # from backward_suite.txt
    not_timed = doc["summary"]["not_timed"]
    assert not_timed["relative_bias_learned:forward_only"].startswith("no_backward")
    assert not_timed["relative_bias_learned:wrong_dv"].startswith("mismatch") and "missing" in not_timed


def test_summary_geomean_over_specs_and_core() -> None:
    def entry(name: str, tier: str, vs_flex: float) -> dict:
        return {"name": name, "tier": tier, "shapes": [{"vs_flex": vs_flex, "records": [{"impl": "emitted", "status": "ok"}]}]}

    s = summarize({"entries": [entry("a", "core", 2.0), entry("b", "core", 0.5), entry("c", "extra", 4.0)]})
    assert s["vs_flex"]["geomean"] == pytest.approx(4 ** (1 / 3)) and s["vs_flex"]["lowest"] == ["b", 0.5]
    assert s["vs_flex_core"]["geomean"] == pytest.approx(1.0) and s["vs_flex_core"]["n"] == 2
    assert s["vs_sdpa"]["n"] == 0 and s["not_timed"] == {}


# ---- without a GPU -------------------------------------------------------------------------------------

@pytest.mark.parametrize("module", ["bench.gpu.tune_bwd", "bench.gpu.tune --backward"])
def test_without_a_gpu_the_cli_says_so_in_one_line(module: str, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", *module.split(), "--suite", str(HELDOUT / "backward_suite.txt"),
           "--from", str(tmp_path), str(tmp_path / "r.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode != 0 and r.stderr.strip() == "timing the backward needs a CUDA GPU; run this on the GPU machine"


# ---- a candidate kb generate wrote (needs the session KB) --------------------------------------------------

@pytest.mark.network
def test_a_generated_differentiable_candidate_is_checked_then_timed(ingested_kb, tmp_path: Path) -> None:
    """The timer's contract with what `kb generate` emits: ModelNew's learnable table (registered under the spec
    Model's key) is made trainable and its gradient checked beside dq, dk, dv."""
    spec = REPO / "examples" / "specs" / "relative_bias.py"
    # the timer checks the gradients itself; verify_kernel=False keeps this test off the verifier's backward mode
    r = generate(ingested_kb, spec, GenerateOptions(out_dir=tmp_path / "out", **{**QUICK, "backward": True,
                                                                                   "verify_kernel": False}))
    if r.backward == "none" and "no backward reference" in r.backward_reason:
        pytest.skip(f"kb generate wrote no backward: {r.backward_reason}")  # until ingest lifts the expert backwards
    assert r.succeeded and r.backward in ("verified", "generated, not verified"), r.backward_reason
    plan = {"schema": PLAN_SCHEMA, "entries": [{"name": "rel", "spec": str(spec), "candidate": str(r.files["candidate"]),
                                                "designs": []}]}
    doc = run_plan_backward(plan, tmp_path / "bwd.json", device="cpu")
    shape = doc["entries"][0]["shapes"][0]
    em = next(x for x in shape["records"] if x["impl"] == "emitted")
    assert shape["learnable"] == ["rel_bias"]
    assert em["status"] == "ok", em
    assert set(em["grad_err"]) == {"q", "k", "v", "rel_bias"} and max(em["grad_err"].values()) < GRAD_TOL


def test_the_cpu_dry_run_runs_from_the_cli(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "bench.gpu.tune_bwd", "--cpu-dry-run", "--suite", str(HELDOUT / "backward_suite.txt"),
           "--tier", "core", "--from", str(tmp_path), str(tmp_path / "r.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 9 and all(": ERROR no candidate" in x for x in lines[:8])  # nothing generated in tmp_path
    assert lines[-1].startswith("x flex: none timed") and "not timed: causal_d128_bf16" in lines[-1]
    assert json.loads((tmp_path / "r.json").read_text())["env"]["dry_run"] == "cpu"


def test_results_written_to_dev_null_leave_it_a_device(tmp_path: Path) -> None:
    """The timers write results whole through a rename, which must not replace /dev/null (or a pipe) by a file."""
    write_results(Path(os.devnull), {"schema": SCHEMA})
    assert Path(os.devnull).is_char_device()
    write_results(tmp_path / "sub" / "r.json", {"schema": SCHEMA})
    assert json.loads((tmp_path / "sub" / "r.json").read_text()) == {"schema": SCHEMA}
    assert not list((tmp_path / "sub").glob("*.tmp"))


def test_forward_outputs_are_judged_by_the_verifiers_bf16_rule() -> None:
    # the causal attention of two keys: an output of magnitude ~2.5, where one bf16 ulp is 1.6e-2
    torch.manual_seed(0)
    v = torch.randn(2, 128) * 2
    p = torch.softmax(torch.randn(1, 2), -1)
    ref = p @ v
    honest = (p.bfloat16().float() @ v.bfloat16().float()).bfloat16()  # P and the output rounded to bf16, as kernels do
    assert output_ok(honest.float(), ref)
    assert not output_ok((ref + 0.5).bfloat16().float(), ref)  # off by 0.5 everywhere
    assert not output_ok(torch.zeros_like(ref), ref)
    assert not output_ok(ref[:, :64], ref)  # wrong shape
