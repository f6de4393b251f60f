"""A wheel built from this checkout and installed somewhere else carries every file `kb` reads at run time.

The wheel is built offline (`pip wheel --no-build-isolation` with the venv's setuptools) from a copy of the
checkout, installed with `pip install --no-deps --target` into a fresh directory, and run as its console script
from a directory outside the repository: the project's code comes from the wheel, its dependencies from the venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support.repo import REPO, TEST_CACHE

pytestmark = pytest.mark.network  # `kb ingest --all` from the wheel reads the pinned releases (cached in .kb-test-cache)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SPEC = REPO / "examples" / "specs" / "sliding_window.py"


def _pip(*args: str, cwd: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def _checkout_packages() -> set[str]:
    """Every package of the checkout: top-level directories with __init__.py (tests aside) and their subpackages."""
    tops = [d for d in REPO.iterdir() if d.name != "tests" and (d / "__init__.py").is_file()]
    return {".".join(p.parent.relative_to(REPO).parts) for top in tops for p in top.rglob("__init__.py")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a copy of the checkout (building writes build/ and *.egg-info, never into the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    setup = PYPROJECT["tool"]["setuptools"]
    tops = {name.split(".")[0] for name in setup["packages"]} | {d.split("/")[0] for d in setup["package-dir"].values()}
    for top in sorted(tops):
        shutil.copytree(REPO / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"), str(src), cwd=tmp)
    (built,) = (tmp / "dist").glob("kernel_kb-*.whl")
    return built


def test_the_wheel_holds_every_package_and_data_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(Path(n).parent).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages == _checkout_packages()  # a new package the [tool.setuptools] list lacks fails here
    shipped = {f"kb/corpus/{p.relative_to(REPO / 'corpus')}" for p in (REPO / "corpus").rglob("*") if p.is_file()}
    assert shipped and any(n.startswith("kb/corpus/measured/") for n in shipped)
    assert shipped | {"retrieve/weights.json"} | {f"bench/kernels/{p.name}" for p in (REPO / "bench/kernels").glob("*.kbir")} <= names
    assert not any(n.startswith(("corpus/", "tests/", "kb/corpus/__init__")) for n in names)  # data, not code


def test_installed_wheel_ingests_the_corpus_and_ranks_a_spec(wheel: Path, tmp_path: Path) -> None:
    target, elsewhere = tmp_path / "target", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel), cwd=elsewhere)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KB_", "PYTHON"))} | {
        "PYTHONPATH": os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]]),
        "KB_HOME": str(tmp_path / "home"), "KB_CACHE_DIR": str(TEST_CACHE), "HF_HUB_OFFLINE": "1"}

    def kb(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(target / "bin" / "kb"), *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=900)

    where = subprocess.run([sys.executable, "-c", "import cli, generate, ingest, kb, retrieve, verify; "
                            "from kb.data_files import corpus_dir; import retrieve.structural as s; "
                            "print(*(m.__file__ for m in (cli, generate, ingest, kb, retrieve, verify)), corpus_dir(), "
                            "s.WEIGHTS_PATH, sep='\\n')"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():  # the project's code and data from the wheel, never from the repository
        assert Path(path).is_relative_to(target), path

    version = kb("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"kernel-kb {PYPROJECT['project']['version']}"

    ingested = kb("ingest", "--all", "--json")
    assert ingested.returncode == 0, ingested.stderr[-3000:]
    doc = json.loads(ingested.stdout)
    assert {f["source"] for f in doc["files"]} == {p.stem for p in (REPO / "corpus").glob("*.toml")}
    assert doc["totals"]["verified"] >= 10 and doc["totals"]["snippets"] >= 40
    assert doc["measured"]["perf_records"] > 0 and doc["measured"]["lessons"] > 0  # corpus/measured/*.json

    found = kb("query", str(SPEC), "-k", "3", "--json")
    assert found.returncode == 0, found.stderr[-3000:]
    result = json.loads(found.stdout)
    assert result["target"]["mask"] == "sliding_window" and len(result["kernels"]) == 3
    weights = json.loads((REPO / "retrieve" / "weights.json").read_text())["weights"]  # the shipped, fitted table
    terms = [k["terms"] for k in result["kernels"]]
    assert all("embedding" in t and set(t) <= set(weights) for t in terms)
    assert any(t.get("mask_same") == weights["mask_same"] for t in terms)
