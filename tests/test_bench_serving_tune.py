"""bench.gpu.serving_tune measures serving designs on tuning specs only (a GPU runs it; here: what it refuses)."""

from __future__ import annotations

import sys

import pytest

from bench.gpu import serving_tune
from kb.ir.design import parse_design


def test_it_refuses_to_tune_on_held_out_specs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "argv", ["serving_tune", "--gen", "x", "--specs", "bench/heldout_serving", "out.json"])
    with pytest.raises(SystemExit) as err:
        serving_tune.main()
    assert err.value.code == 2 and "tune on tuning specs" in capsys.readouterr().err


def test_its_design_grids_are_designs() -> None:
    for text in (*serving_tune.DECODE_DESIGNS, *serving_tune.PREFILL_DESIGNS):
        assert str(parse_design(text)) == text
