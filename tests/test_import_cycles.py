"""No hidden import cycles: the project's module graph is acyclic, function-local and TYPE_CHECKING imports included.

import-linter's layers contract (`lint-imports`) keeps the packages in order, but says nothing about two
modules of one package importing each other; a function-local or `if TYPE_CHECKING:` import hides such a
circle from Python at start-up, not from a reader. grimp (the graph import-linter builds on) records every
`import` statement of a module wherever it stands, in a function body or under `if TYPE_CHECKING:`
(`exclude_type_checking_imports=False`, its default, spelt out below); the second test pins that. The graph
covers every module of the packages import-linter checks, so a cycle across two of them is caught too.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp
import pytest

from tests.support.repo import REPO


def _root_packages() -> list[str]:
    """The packages import-linter checks (pyproject's [tool.importlinter]), so both checks see the same code."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return list(config["tool"]["importlinter"]["root_packages"])


def _describe(graph: grimp.ImportGraph, cycle: tuple[str, ...]) -> str:
    """`a -> b -> a`, each step with the line that imports: the place to cut is one of them."""
    steps = []
    for importer, imported in zip(cycle, cycle[1:]):
        details = graph.get_import_details(importer=importer, imported=imported)
        where = "; ".join(f"line {d['line_number']}: {d['line_contents']}" for d in details)
        steps.append(f"  {importer} -> {imported}  ({where})")
    return "\n".join(steps)


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*_root_packages(), exclude_type_checking_imports=False, cache_dir=None)
    cycles: dict[frozenset[str], tuple[str, ...]] = {}  # one report per set of modules
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycles.setdefault(frozenset(back), (importer, *back))
    if cycles:
        report = "\n\n".join(_describe(graph, c) for c in cycles.values())
        pytest.fail(f"{len(cycles)} import cycle(s); move what both sides need into a module both import:\n{report}",
                    pytrace=False)


def test_hidden_imports_are_in_the_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The premise of the check above: an import inside a function or under TYPE_CHECKING is an edge."""
    pkg = tmp_path / "kb_cycle_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from kb_cycle_probe import b\n    return b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from kb_cycle_probe import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("kb_cycle_probe", exclude_type_checking_imports=False, cache_dir=None)
    assert graph.direct_import_exists(importer="kb_cycle_probe.a", imported="kb_cycle_probe.b")
    assert graph.direct_import_exists(importer="kb_cycle_probe.b", imported="kb_cycle_probe.a")
