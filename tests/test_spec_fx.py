"""generate.spec_fx records the graph torch's make_fx(pre_dispatch=True) records, without importing torch._dynamo:
node for node (op, target, arguments, result shape and dtype, constants' values, the file an error names)
over every spec and mod the repository ships, errors included; and in a fresh process tracing a spec leaves
torch._dynamo and torch._inductor unimported."""

from __future__ import annotations

import operator
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from generate import spec_trace
from generate.spec import load_spec
from generate.spec_fx import record_graph
from kb.errors import KBError
from tests.support.repo import REPO, subprocess_env

_SPEC_DIRS = ("examples/specs", "bench/heldout", "bench/heldout_serving", "bench/specs", "bench/tuning", "tests/data",
              "tests/support/verify_fixtures")


def _spec_files() -> list[Path]:
    files = [p for d in _SPEC_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    return [p for p in files if any(w in p.read_text(errors="replace") for w in ("def get_inputs", "_mod("))]


def _signature(gm: torch.fx.GraphModule) -> list[tuple[Any, ...]]:
    index: dict[torch.fx.Node, int] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, float) and a != a:
            return "nan"
        return repr(a)

    rows = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        val = n.meta.get("val")
        shape = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
        target: Any = n.target
        if n.op == "get_attr":
            t = getattr(gm, n.target)
            target = (n.target, tuple(t.shape), t.dtype, t.detach().double().sum().item())
        rows.append((n.op, str(target), arg(n.args), tuple(sorted((k, arg(v)) for k, v in n.kwargs.items())),
                     shape if n.op != "output" else None))
    return rows


def _lines(gm: torch.fx.GraphModule, source: str | None) -> list[str]:
    """The file each op's error would name ('' when none)."""
    wheres = [spec_trace._where(n, source) for n in gm.graph.nodes
              if n.op == "call_function" and n.target is not operator.getitem]
    return [w.split(":")[0] if w != "at an unknown line" else "" for w in wheres]


def test_graphs_equal_make_fx_over_every_shipped_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    checked, mismatches = [], []
    record = spec_trace.record_graph

    def both(fn: Any, inputs: Any, *, source: str | None = None) -> torch.fx.GraphModule:
        copies = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        try:
            theirs, their_err = make_fx(fn, pre_dispatch=True, record_stack_traces=True)(*copies), None
        except Exception as err:
            theirs, their_err = None, err
        try:
            mine = record(fn, inputs)
        except Exception as err:
            assert their_err is not None, f"{current}: make_fx traced it, record_graph raised {err!r}"
            assert ("data-dependent" in str(err)) == ("data-dependent" in str(their_err)), current
            raise
        assert their_err is None, f"{current}: record_graph traced it, make_fx raised {their_err!r}"
        a, b = _signature(theirs), _signature(mine)
        if a != b:
            mismatches.append((current, next((x, y) for x, y in zip(a + [None], b + [None]) if x != y)))
        # make_fx names a line only in a module's forward (a mod traced alone names none); where it does, so do we,
        # in the same file (the innermost user frame, which may be a mod called from that forward)
        if any(x and x != y for x, y in zip(_lines(theirs, source), _lines(mine, source), strict=True)):
            mismatches.append((current, "source lines"))
        checked.append(current)
        return mine

    monkeypatch.setattr(spec_trace, "record_graph", lambda fn, inputs: both(fn, inputs, source=current_source))
    files = _spec_files()
    assert len(files) > 100
    for path in files:
        current, current_source = path.relative_to(REPO), str(path)
        try:
            load_spec(path)
        except KBError:
            pass
    assert not mismatches, mismatches
    assert len(set(checked)) > 100


def test_tracing_leaves_dynamo_and_inductor_unimported() -> None:
    probe = ("import sys\nfrom generate.spec import load_spec\nload_spec(sys.argv[1])\n"
             "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))")
    run = subprocess.run([sys.executable, "-c", probe, str(REPO / "examples" / "specs" / "flex_document_softcap.py")],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_data_dependent_reads_of_inputs_are_refused_and_constants_run() -> None:
    def reads_input(x: torch.Tensor) -> torch.Tensor:
        return x * int(x[0])

    with pytest.raises(RuntimeError, match="data-dependent"):
        record_graph(reads_input, [torch.arange(4)])

    def reads_constant(x: torch.Tensor) -> torch.Tensor:
        return x * int(torch.tensor(3) + 1)

    gm = record_graph(reads_constant, [torch.arange(4)])
    assert torch.equal(gm(torch.arange(4)), torch.arange(4) * 4)
