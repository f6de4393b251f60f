"""`kb query SPEC` remembers what a spec traced to (generate.spec_cache): asked again it does not trace, and gives
the same answer; the first time it traces in a forked child, so the command's own process never imports torch;
editing the spec or a file beside it traces again; a damaged or unwritable cache is only slower; the child's
errors reach the user as the same one-line message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from generate.spec import load_spec
from generate.spec_cache import trace_key, trace_spec_file
from kb.errors import KBError
from tests.support.repo import KB_CLI, REPO, subprocess_env
from tests.support.store import make_kernel

SPEC = REPO / "examples" / "specs" / "prefix_lm.py"

PROBE = """import sys
import generate.spec_cache as cache
traced = cache.trace_spec_file
def tracing(*args):
    print('TRACED', file=sys.stderr, flush=True)
    return traced(*args)
cache.trace_spec_file = tracing
from cli.main import app
try:
    app(['query', sys.argv[1], '-k', '3', '--json'])
except SystemExit as e:
    assert not e.code, e.code
print('TORCH', 'torch' in sys.modules, file=sys.stderr)
"""


def _query(home: Path, spec: Path) -> tuple[dict, bool]:
    run = subprocess.run([sys.executable, "-c", PROBE, str(spec)], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=subprocess_env(KB_HOME=str(home)))
    assert run.returncode == 0, run.stderr
    assert "TORCH False" in run.stderr  # the child traced
    return json.loads(run.stdout), "TRACED" in run.stderr


def test_asked_again_a_spec_is_not_traced(kb, tmp_path: Path) -> None:
    spec = tmp_path / "specs" / "prefix_lm.py"
    spec.parent.mkdir()
    shutil.copy(SPEC, spec)
    for i in range(4):
        kb.write_kernel(make_kernel(i))
    kb.close()
    home = kb.settings.home
    first, traced = _query(home, spec)
    again, traced_again = _query(home, spec)
    assert traced and not traced_again  # the second run ranked from the cache
    assert first["target"]["mask"] == "prefix_lm" and again["target"] == first["target"]
    assert [k["id"] for k in again["kernels"]] == [k["id"] for k in first["kernels"]]  # numpy vs torch embedding: 1e-7
    assert all(abs(a["score"] - b["score"]) < 1e-5 for a, b in zip(again["kernels"], first["kernels"], strict=True))
    spec.write_text(spec.read_text().replace("B, H, S, D, PREFIX = 2, 4, 128, 64, 24", "B, H, S, D, PREFIX = 2, 4, 128, 32, 24"))
    edited = trace_spec_file(spec, home / "cache")  # the same cache the two runs used
    assert edited.features.head_dim == 32 and len(list((home / "cache" / "spec-traces").glob("*.json"))) == 2


def test_key_follows_the_spec_and_its_siblings(tmp_path: Path) -> None:
    spec = tmp_path / "a.py"
    spec.write_text("x = 1\n")
    base = trace_key(spec)
    assert trace_key(spec) == base
    (tmp_path / "helper.py").write_text("y = 2\n")
    with_sibling = trace_key(spec)
    assert with_sibling != base
    (tmp_path / "helper.py").write_text("y = 3\n")
    assert trace_key(spec) != with_sibling


def test_damaged_or_unwritable_cache_still_answers(tmp_path: Path) -> None:
    spec = tmp_path / "prefix_lm.py"
    shutil.copy(SPEC, spec)
    cache = tmp_path / "cache"
    want = load_spec(spec).features
    assert trace_spec_file(spec, cache).features == want
    (entry,) = (cache / "spec-traces").glob("*.json")
    for damage in ("{not json", json.dumps({"features": json.dumps({"head_dim": "64"}), "score_mod": None,
                                            "mask_mod": None})):
        entry.write_text(damage)
        assert trace_spec_file(spec, cache).features == want
        assert json.loads(entry.read_text())["features"] == want.to_json()  # rewritten
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache directory would be")
    assert trace_spec_file(spec, blocked).features == want


def test_an_error_in_the_tracing_child_is_the_users_one_line(kb, tmp_path: Path) -> None:
    bad = REPO / "tests" / "data" / "specs_bad" / "op_after_softmax.py"
    kb.close()
    try:
        load_spec(bad)
    except KBError as err:
        want = str(err)
    run = subprocess.run([*KB_CLI, "query", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=subprocess_env(KB_HOME=str(kb.settings.home)))
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert want in " ".join(run.stderr.split())  # the same message the in-process tracer gives (rich may wrap it)


def test_the_tracing_child_is_stopped_when_the_query_fails_first(tmp_path: Path) -> None:
    spec = tmp_path / "slow_spec.py"
    spec.write_text("import time\ntime.sleep(600)\n")  # a child left behind would sleep on, under the same command line
    run = subprocess.run([*KB_CLI, "query", str(spec)], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=subprocess_env(KB_HOME=str(tmp_path / "no-kb")))
    assert run.returncode != 0 and "no knowledge base" in run.stderr and "Traceback" not in run.stderr
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(spec).encode() in cmdline.read_bytes():
                left.append(cmdline.parent.name)
        except OSError:
            pass  # exited while we looked
    assert not left, f"processes still running the spec: {left}"
