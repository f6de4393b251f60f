"""A constant computed from the head count is written in Hq where traces at other head counts say how; a kernel
holding a constant that depends on the head count in another way, or on a constructor argument, refuses other
values instead of answering wrongly."""

from __future__ import annotations

import importlib.util
import os

os.environ["TRITON_INTERPRET"] = "1"  # the test calls the candidate in-process

from pathlib import Path

import pytest
import torch

from generate.pipeline import GenerateOptions, generate
from generate.spec import load_spec
from kb.ir.expr import print_expr
from tests.support.generate_fixtures import QUICK
from tests.support.repo import REPO

pytestmark = pytest.mark.network  # the session KB ingests the real flash-attn release

SPEC = REPO / "tests" / "data" / "specs_state" / "alibi_slopes_in_forward.py"


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_constants_computed_from_the_head_count_are_written_in_hq(ingested_kb, tmp_path: Path) -> None:
    """ALiBi slopes built in forward from q.shape[1] (attention-gym's and MPT's way): the kernel generated from the
    spec's 4-head inputs computes them from Hq, so it answers like the Model at 4, 8 and 6 heads."""
    spec = load_spec(SPEC)
    assert spec.heads_fixed is None and "/ Hq" in print_expr(spec.score_mod)
    r = generate(ingested_kb, SPEC, GenerateOptions(out_dir=tmp_path, **QUICK))
    assert r.succeeded, r.error
    cand, model = _module(r.files["candidate"], "cand_heads"), _module(SPEC, "spec_heads")
    for heads in (4, 8, 6):
        q, k, v = (torch.randn(1, heads, 40, 32) for _ in range(3))
        torch.testing.assert_close(cand.ModelNew()(q, k, v), model.Model()(q, k, v), atol=1e-4, rtol=1e-4)


def test_head_count_dependent_constants_are_refused_at_other_head_counts(ingested_kb, tmp_path: Path) -> None:
    """A divisor that follows the head count at 4 and 8 heads but not at 12 (the nearest power of two below it) has
    no expression in Hq: the kernel holds 4 heads and refuses others instead of answering wrongly."""
    spec_path = REPO / "tests" / "data" / "specs_state" / "alibi_slopes_nearest_pow2.py"
    assert load_spec(spec_path).heads_fixed == 4
    assert load_spec(REPO / "examples" / "specs" / "alibi.py").heads_fixed is None  # slopes held as state: any H
    r = generate(ingested_kb, spec_path, GenerateOptions(out_dir=tmp_path, **QUICK))
    assert r.succeeded, r.error
    cand, spec = _module(r.files["candidate"], "cand_pow2"), _module(spec_path, "spec_pow2")
    q, k, v = (torch.randn(1, 4, 40, 32) for _ in range(3))
    torch.testing.assert_close(cand.ModelNew()(q, k, v), spec.Model()(q, k, v), atol=1e-4, rtol=1e-4)
    q8, k8, v8 = (torch.randn(1, 8, 40, 32) for _ in range(3))
    with pytest.raises(ValueError, match="generated for 4 query heads"):
        cand.ModelNew()(q8, k8, v8)


def test_constructor_arguments_held_as_constants_are_refused_when_changed(ingested_kb, tmp_path: Path) -> None:
    window = REPO / "examples" / "specs" / "sliding_window.py"
    assert load_spec(window).init_fixed == ((0, "window", 32),)
    r = generate(ingested_kb, window, GenerateOptions(out_dir=tmp_path, **QUICK))
    assert r.succeeded, r.error
    cand = _module(r.files["candidate"], "cand_window")
    cand.ModelNew(32)
    with pytest.raises(ValueError, match="generated for window=32"):
        cand.ModelNew(48)


def test_a_table_sized_by_a_constructor_argument_is_read_at_its_own_size(ingested_kb, tmp_path: Path) -> None:
    """The offset max_len - 1 into a table of 2 * max_len - 1 columns is read from the table given at run time, so a
    kernel generated with max_len=64 serves Models built with other max_len and head counts."""
    spec_path = REPO / "tests" / "data" / "specs_state" / "relative_table_max_len.py"
    spec = load_spec(spec_path)
    assert spec.init_fixed == () and "(rel_n1 - 1) // 2" in print_expr(spec.score_mod)
    r = generate(ingested_kb, spec_path, GenerateOptions(out_dir=tmp_path, **QUICK))
    assert r.succeeded, r.error
    assert spec.features.score_mod == "relative_bias"  # still a relative-position table (retrieval, lowering)
    assert "one read of the table" not in r.files["triton"].read_text()  # the offset moves nothing over a tile
    cand, model_mod = _module(r.files["candidate"], "cand_max_len"), _module(spec_path, "spec_max_len")
    for heads, length, max_len in ((4, 40, 64), (2, 24, 100), (3, 30, 30)):
        model, new = model_mod.Model(heads, max_len), cand.ModelNew(heads, max_len)
        new.load_state_dict(model.state_dict())
        q, k, v = (torch.randn(1, heads, length, 32) for _ in range(3))
        torch.testing.assert_close(new(q, k, v), model(q, k, v), atol=1e-4, rtol=1e-4)


def test_lengths_are_held_when_the_spec_runs_at_no_other_lengths(ingested_kb, tmp_path: Path) -> None:
    """A table indexed `i - j + seq - 1` by a Model that runs at length `seq` only: nothing tells the offset from the
    length, so the kernel holds (M, N) and refuses other lengths instead of reading its table at the wrong offset.
    A table indexed the same way that runs at shorter lengths too gets `N - 1`, and any length."""
    spec_path = REPO / "tests" / "data" / "specs_state" / "relative_table_own_length.py"
    assert load_spec(spec_path).lengths_fixed == (48, 48)
    assert load_spec(REPO / "tests" / "data" / "specs" / "relative_bias_table.py").lengths_fixed is None
    assert load_spec(REPO / "bench" / "heldout" / "local_band_bidir.py").lengths_fixed is None  # a sliced buffer
    r = generate(ingested_kb, spec_path, GenerateOptions(out_dir=tmp_path, **QUICK))
    assert r.succeeded, r.error
    cand, spec = _module(r.files["candidate"], "cand_lengths"), _module(spec_path, "spec_lengths")
    new, model = cand.ModelNew(48), spec.Model(48)
    new.load_state_dict(model.state_dict())
    q, k, v = (torch.randn(1, 4, 48, 32) for _ in range(3))
    torch.testing.assert_close(new(q, k, v), model(q, k, v), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"generated for sequence lengths \(M, N\) = \(48, 48\)"):
        new(*(torch.randn(1, 4, 40, 32) for _ in range(3)))
