"""`kernel_kb.load(SPEC | KERNEL_ID | OUT_DIR)`: a generated kernel as a module, ready to call, generating only
on a cache miss; the same thing loaded twice is the same module; bad input is one KBError line."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # the loaded modules run in this process; set before triton is imported

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

import kernel_kb
from kb.settings import Settings, load_settings
from kb.store import open_kb
from kb.store.models import Kernel
from tests.support.ingested import private_copy
from tests.support.repo import REPO

pytestmark = pytest.mark.network  # the session KB ingests the real flash-attn release

SPEC = REPO / "examples" / "specs" / "causal_d64.py"  # fp32 causal, D=64: cheap to generate and to interpret
STEM = "gen_causal_d64"


@pytest.fixture(scope="module")
def loaded(ingested_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, ModuleType]]:
    """(settings of a KB copy, the module `kernel_kb.load(SPEC)` returned there: a miss, so generated)."""
    with private_copy(ingested_home, tmp_path_factory.mktemp("load")) as home:
        settings = load_settings(home=home)
        yield settings, kernel_kb.load(SPEC, settings=settings, target="sm90", backward=False)


def _runs(settings: Settings, embedder) -> int:
    with open_kb(settings, embedder=embedder, create=False) as kb:
        return kb.counts().rows["generation_runs"]


def _qkv(S: int = 40) -> tuple[torch.Tensor, ...]:  # ragged: 40 is no multiple of a block
    torch.manual_seed(0)
    return tuple(torch.randn(1, 2, S, 64) for _ in range(3))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _report(module: ModuleType) -> dict:
    return json.loads(Path(module.__file__).with_name(f"{STEM}.report.json").read_text())


def test_load_by_spec_returns_a_module_that_computes_the_spec(loaded) -> None:
    _, mod = loaded
    q, k, v = _qkv()
    o, lse = mod.forward(q, k, v)
    torch.testing.assert_close(o, _reference(q, k, v), atol=1e-4, rtol=1e-4)
    assert lse.shape == (1, 2, 40)
    torch.testing.assert_close(mod.ModelNew(128)(q, k, v), _reference(q, k, v), atol=1e-4, rtol=1e-4)
    assert _report(mod)["status"] == "verified"


def test_loading_a_spec_again_is_a_cache_hit_and_the_same_module(loaded, embedder) -> None:
    settings, mod = loaded
    runs = _runs(settings, embedder)
    assert kernel_kb.load(SPEC, settings=settings, target="sm90", backward=False) is mod
    assert kernel_kb.load(str(SPEC), home=settings.home, target="sm90", backward=False) is mod
    assert _runs(settings, embedder) == runs, "a hit generates nothing"


def test_load_by_kernel_id(loaded) -> None:
    settings, mod = loaded
    kid = _report(mod)["kernel_id"]
    by_id = kernel_kb.load(kid, settings=settings)
    assert kernel_kb.load(kid, settings=settings) is by_id
    assert Path(by_id.__file__).parent == settings.home / "generated" / "kernels"
    q, k, v = _qkv()
    torch.testing.assert_close(by_id.forward(q, k, v)[0], _reference(q, k, v), atol=1e-4, rtol=1e-4)


def test_load_by_output_directory_or_file(loaded, tmp_path: Path) -> None:
    settings, _ = loaded
    out = tmp_path / "out"
    published = kernel_kb.load(SPEC, settings=settings, target="sm90", backward=False, out=out)  # a hit, published
    assert Path(published.__file__) == (out / f"{STEM}.py").resolve()
    assert json.loads((out / f"{STEM}.report.json").read_text())["cached"]
    assert kernel_kb.load(out) is published and kernel_kb.load(out / f"{STEM}.py") is published
    triton = kernel_kb.load(out / f"{STEM}_triton.py")
    q, k, v = _qkv()
    torch.testing.assert_close(triton.forward(q, k, v)[0], _reference(q, k, v), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(published.ModelNew(128)(q, k, v), _reference(q, k, v), atol=1e-4, rtol=1e-4)


def _one_line_error(what: object, match: str, **kw: object) -> None:
    with pytest.raises(kernel_kb.KBError, match=match) as err:
        kernel_kb.load(what, **kw)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_a_directory_of_several_specs_names_them(loaded, tmp_path: Path) -> None:
    _, mod = loaded
    src = Path(mod.__file__).parent
    for name in ("gen_a", "gen_b"):
        shutil.copy(src / f"{STEM}.py", tmp_path / f"{name}.py")
        shutil.copy(src / f"{STEM}.report.json", tmp_path / f"{name}.report.json")
    _one_line_error(tmp_path, r"kernels of 2 specs; load one of them: .*gen_a\.py, .*gen_b\.py")
    assert kernel_kb.load(tmp_path / "gen_a.py").__file__ == str((tmp_path / "gen_a.py").resolve())


def test_bad_input_is_one_kberror_line(loaded, embedder, tmp_path: Path) -> None:
    settings, _ = loaded
    _one_line_error(tmp_path / "nope.py", "no such spec file, output directory or kernel id")
    _one_line_error("k-0000000000000000", "no kernel k-0000000000000000 in the KB", settings=settings)
    _one_line_error(tmp_path, "holds no generated kernel")
    with open_kb(settings, embedder=embedder, create=False) as kb:
        ingested = next(k for k in kb.list_kernels(origin="ingest") if not k.triton_src)
    assert isinstance(ingested, Kernel)
    _one_line_error(ingested.id, "holds no Triton module", settings=settings)
    (tmp_path / "gen_x.py").write_text("")
    (tmp_path / "gen_x.report.json").write_text(json.dumps({"status": "failed"}))
    _one_line_error(tmp_path / "gen_x.py", "the run failed; there is no kernel to load")
    _one_line_error(tmp_path, "holds no generated kernel")
    not_a_spec = tmp_path / "plain.py"
    not_a_spec.write_text("x = 1\n")
    _one_line_error(not_a_spec, "no kernel could be generated for .*plain.py: .*not a spec", settings=settings,
                    backward=False)
