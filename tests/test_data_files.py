"""The data files kernel-kb ships are found, or their absence is an error: never an empty corpus or unfitted weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from generate.perf_import import corpus_results
from ingest.manifest import list_manifests
from kb import data_files
from kb.data_files import corpus_dir
from kb.errors import KBError
from retrieve.structural import load_weights
from tests.support.repo import REPO


def test_a_checkout_reads_its_top_level_corpus() -> None:
    assert corpus_dir() == REPO / "corpus"
    assert {m.name for m in list_manifests()} == {p.stem for p in (REPO / "corpus").glob("*.toml")}
    assert corpus_results() == sorted((REPO / "corpus" / "measured").glob("*.json"))


def test_an_installed_corpus_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    installed, checkout = tmp_path / "site" / "kb" / "corpus", tmp_path / "repo" / "corpus"
    for d in (installed, checkout):
        d.mkdir(parents=True)
    (tmp_path / "repo" / "pyproject.toml").write_text("")
    monkeypatch.setattr(data_files, "_candidates", lambda: (installed, checkout))
    assert corpus_dir() == installed


def test_a_missing_corpus_is_an_error_naming_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    installed, checkout = tmp_path / "site" / "kb" / "corpus", tmp_path / "site" / "corpus"
    checkout.mkdir(parents=True)  # another distribution's corpus/ beside kb, not a checkout: not ours
    monkeypatch.setattr(data_files, "_candidates", lambda: (installed, checkout))
    for call in (corpus_dir, list_manifests, corpus_results):
        with pytest.raises(KBError, match=f"corpus/ is missing: not in {installed} .* nor in {checkout}"):
            call()


def test_a_corpus_without_its_files_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "corpus").mkdir()
    monkeypatch.setattr(data_files, "_candidates", lambda: (tmp_path / "corpus", tmp_path / "none"))
    with pytest.raises(KBError, match=r"holds no \*.toml files"):
        list_manifests()
    with pytest.raises(KBError, match=r"holds no measured/\*.json files"):
        corpus_results()


def test_missing_weights_are_an_error_not_the_defaults(tmp_path: Path) -> None:
    with pytest.raises(KBError, match="fitted retrieval weights .*weights.json are missing"):
        load_weights(tmp_path / "weights.json")
