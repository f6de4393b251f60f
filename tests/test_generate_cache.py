"""The generate cache: a second `kb generate` of an unchanged spec against an unchanged KB is served from the cache
(no attempt, no run, the same kernel and files); `--force`, a changed spec, other options, new expert or measured
knowledge, other code, or a kernel the KB no longer vouches for make it generate again."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from sqlmodel import Session
from typer.testing import CliRunner

from cli.main import app
from generate import cache
from generate.cache import cache_key, code_digest, generate_cached, lookup, specs_dir
from generate.pipeline import GenerateOptions
from kb.settings import load_settings
from kb.store import open_kb
from kb.store.models import Kernel, Lesson, Tunable
from tests.support.generate_fixtures import QUICK
from tests.support.ingested import private_copy
from tests.support.repo import REPO

pytestmark = pytest.mark.network  # the session KB ingests the real flash-attn release

SPEC = REPO / "examples" / "specs" / "causal_d64.py"
STEM = "gen_causal_d64"
ARGS = ["generate", str(SPEC), "--no-backward", "--target", "sm90"]
runner = CliRunner()


def _kb(home: Path, *args: str):
    res = runner.invoke(app, ["--home", str(home), *args], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    return res


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if not p.name.endswith(".report.json")}


def _report(out: Path) -> dict:
    return json.loads((out / f"{STEM}.report.json").read_text())


def _rows(home: Path, embedder) -> dict[str, int]:
    with open_kb(load_settings(home=home), embedder=embedder, create=False) as kb:
        return dict(kb.counts().rows)


@pytest.fixture(scope="module")
def generated(ingested_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(KB home, --out) after one `kb generate` of SPEC: a miss, which generated and cached the kernel."""
    with private_copy(ingested_home, tmp_path_factory.mktemp("cache")) as home:
        out = home.parent / "out1"
        res = _kb(home, *ARGS, "--out", str(out))
        assert "(cached)" not in res.output
        yield home, out


def _copy(home: Path, tmp_path: Path) -> Path:
    """A private copy of the generated home (KB and cache), for a test that changes it."""
    mine = tmp_path / "kb"
    shutil.copytree(home, mine)
    return mine


def test_a_second_generate_is_served_from_the_cache(generated, embedder, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    home, out1 = generated
    first = _report(out1)
    assert first["status"] == "verified" and first["attempts"] and "cached" not in first
    before = _rows(home, embedder)
    monkeypatch.setattr(cache, "generate", lambda *a, **k: pytest.fail("a cache hit generated"))
    out2 = tmp_path / "out2"
    res = _kb(home, *ARGS, "--out", str(out2))
    assert "verified (cached)" in res.output
    assert f"from the cache, made by run {first['run_id']}" in res.output
    assert _rows(home, embedder) == before, "a hit records no run, attempt, lesson or kernel"
    assert _files(out2) == _files(out1)  # the same candidate, Triton module, state, IR and CUDA, byte for byte
    second = _report(out2)
    cached = second.pop("cached")
    assert second == first  # the generating run's report, unchanged apart from where it came from
    manifest = json.loads((specs_dir(load_settings(home=home)) / cached["key"] / "entry.json").read_text())
    assert cached["run_id"] == first["run_id"] == manifest["run_id"] and manifest["kernel_id"] == first["kernel_id"]
    assert manifest["parts"]["target"] == "sm90"


def test_force_regenerates_and_refreshes_the_entry(generated, embedder, tmp_path: Path) -> None:
    home = _copy(generated[0], tmp_path)
    first = _report(generated[1])
    before = _rows(home, embedder)
    _kb(home, *ARGS, "--force", "--out", str(tmp_path / "forced"))
    forced = _report(tmp_path / "forced")
    assert "cached" not in forced and forced["run_id"] != first["run_id"] and forced["attempts"]
    assert forced["kernel_id"] == first["kernel_id"] and forced["kernel_was_in_kb"]  # the same program again
    after = _rows(home, embedder)
    assert after["generation_runs"] == before["generation_runs"] + 1 and after["attempts"] > before["attempts"]
    _kb(home, *ARGS, "--out", str(tmp_path / "again"))
    assert _report(tmp_path / "again")["cached"]["run_id"] == forced["run_id"], "the entry now holds the forced run"


@pytest.fixture
def kb_of(generated, embedder) -> Iterator:
    with open_kb(load_settings(home=generated[0]), embedder=embedder, create=False) as kb:
        yield kb


OPTS = GenerateOptions(backward=False, target="sm90")  # what `kb generate --no-backward --target sm90` passes


def test_a_changed_spec_misses(kb_of, tmp_path: Path) -> None:
    assert lookup(kb_of, cache_key(kb_of, SPEC, OPTS)) is not None
    same = tmp_path / "elsewhere" / SPEC.name
    same.parent.mkdir()
    shutil.copy(SPEC, same)
    assert lookup(kb_of, cache_key(kb_of, same, OPTS)) is not None, "the key is the spec's content and name, not its place"
    changed = tmp_path / SPEC.name
    changed.write_text(SPEC.read_text().replace("B, H, S, D = 2, 4, 128, 64", "B, H, S, D = 2, 4, 96, 64"))
    assert lookup(kb_of, cache_key(kb_of, changed, OPTS)) is None
    renamed = tmp_path / "causal_d64_copy.py"
    shutil.copy(SPEC, renamed)  # another file name: another program name and other files
    assert lookup(kb_of, cache_key(kb_of, renamed, OPTS)) is None


def test_the_key_covers_every_option_that_changes_the_output(kb_of) -> None:
    base = cache_key(kb_of, SPEC, OPTS).digest
    changed = [replace(OPTS, target="sm80"), replace(OPTS, backward=True), replace(OPTS, memory=False),
               replace(OPTS, verify_kernel=False), replace(OPTS, engine="llm"), replace(OPTS, compile_cuda=False),
               replace(OPTS, verify_distributions=("normal",))]
    digests = [cache_key(kb_of, SPEC, o).digest for o in changed]
    assert base not in digests and len(set(digests)) == len(digests)
    # the search budget bounds the work, not what a passing kernel is
    assert cache_key(kb_of, SPEC, replace(OPTS, max_attempts=2, timeout_s=30.0, references=1)).digest == base


def test_new_expert_or_measured_knowledge_changes_the_key_and_write_back_does_not(ingested_kb) -> None:
    base = cache_key(ingested_kb, SPEC, OPTS).digest
    ingested_kb.write_lesson(Lesson(kind="strategy_reuse", text="a lesson a run wrote back"))
    assert cache_key(ingested_kb, SPEC, OPTS).digest == base
    ingested_kb.write_tunables([Tunable(family="fa2", arch="sm90", head_dim=64, params_json='{"BLOCK_M": 64}')])
    assert cache_key(ingested_kb, SPEC, OPTS).digest != base


def test_the_code_digest_follows_every_file(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "weights.json").write_text("{}")
    base = code_digest([pkg])
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"compiled")
    assert code_digest([pkg]) == base
    (pkg / "weights.json").write_text('{"w": 1}')
    assert code_digest([pkg]) != base
    assert cache.code_version().startswith("0.") and "+" in cache.code_version()


@pytest.mark.parametrize("damage", ["file changed", "kernel unverified"])
def test_an_entry_the_kb_no_longer_vouches_for_is_dropped(generated, embedder, tmp_path: Path, damage: str) -> None:
    home = _copy(generated[0], tmp_path)
    with open_kb(load_settings(home=home), embedder=embedder, create=False) as kb:
        key = cache_key(kb, SPEC, OPTS)
        entry = lookup(kb, key)
        assert entry is not None
        if damage == "file changed":
            entry.file("triton").write_text(entry.file("triton").read_text() + "\n# edited\n")
        else:
            with Session(kb.engines.write) as s:
                row = s.get(Kernel, entry.kernel_id)
                row.verified = False
                s.add(row)
                s.commit()
        assert lookup(kb, key) is None
        assert not entry.path.exists(), "a stale entry is removed, never served later"


def test_a_failed_run_is_never_cached(ingested_kb, tmp_path: Path) -> None:
    r = generate_cached(ingested_kb, REPO / "tests/data/specs_bad/op_after_softmax.py",
                        GenerateOptions(out_dir=tmp_path, **QUICK))
    assert not r.succeeded and r.cached is None
    root = specs_dir(ingested_kb.settings)
    assert not root.exists() or not [p for p in root.iterdir() if not p.name.startswith(".")]
