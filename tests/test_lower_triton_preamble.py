"""The runtime preamble of generated Triton modules (kb/lower/triton_preamble.py): imported and run as a module,
and pasted byte for byte into what kb.lower.triton generates."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below (as the lowering tests run)

from pathlib import Path

import pytest
import torch

from kb.ir.interpret import run_program
from kb.ir.nodes import Dtype, Param, Role
from kb.lower import triton_preamble as pre
from kb.lower.runtime import TritonKernel
from kb.lower.triton import lower_program
from tests.support.ir_programs import FIXTURES, forward


def test_generated_modules_carry_the_preamble_text() -> None:
    text = Path(pre.__file__).read_text()
    body = text.split("preamble begins", 1)[1].split("\n", 1)[1].split("# ---- generated modules: preamble ends")[0]
    assert body.startswith("import concurrent.futures\n") and body.endswith("\n")
    assert lower_program(FIXTURES["causal"]()).split("\n", 2)[2].startswith(body)


def test_host_load_reads_zero_out_of_range() -> None:
    t = torch.arange(6.0).view(2, 3)
    rows, cols = torch.tensor([0, 1, 2, -1]), torch.tensor([2, 0, 0, 1])
    assert pre._hload(t, (rows, cols)).tolist() == [2.0, 3.0, 0.0, 0.0]


def test_host_helpers_take_ints_and_tensors() -> None:
    assert pre._hcdiv(7, 2) == 4 and pre._hmaximum(3, 5) == 5 and pre._hwhere(False, 1, 2) == 2
    assert pre._hminimum(torch.tensor([1, 9]), 4).tolist() == [1, 4]
    assert pre._htrunc(-2.7) == -2 and pre._htrunc(torch.tensor([-2.7, 2.7])).tolist() == [-2, 2]


def test_block_lists_count_then_index_each_class() -> None:
    classes = torch.tensor([0, 1, 2, 1], dtype=torch.int8).view(1, 1, 1, 4)  # empty, partial, full, partial
    lists = pre._hblock_lists(classes)[0, 0, 0]
    assert lists[0, :5].tolist() == [0, 0, 1, 1, 2] and lists[0, 5:7].tolist() == [1, 3]  # partial: blocks 1, 3
    assert lists[1, :5].tolist() == [0, 0, 0, 1, 1] and lists[1, 5].item() == 2  # full: block 2


def test_split_rule_fills_waves_and_keeps_splits_long() -> None:
    assert pre._split_rule(programs=132, kv_blocks=64, sms=132) == 2
    assert pre._split_rule(programs=8, kv_blocks=8, sms=132) == 2  # at most kv_blocks // 4 splits
    assert pre._split_rule(programs=1000, kv_blocks=64, sms=132) == 1
    assert pre._auto_splits(8, 64, torch.device("cpu")) == 1


def test_bind_checks_shapes() -> None:
    dims: dict = {}
    pre._bind(dims, "q", torch.empty(2, 3, 5), ("B", "H", 5))
    assert dims == {"B": 2, "H": 3}
    with pytest.raises(pre.ForwardArgumentError, match="dim B is 4 here but 2 elsewhere"):
        pre._bind(dims, "k", torch.empty(4, 3, 5), ("B", "H", 5))


def test_block_table_cache_rebuilds_only_on_changed_inputs() -> None:
    ids, built = torch.tensor([0, 0, 1]), []

    def build() -> str:
        built.append(1)
        return f"table{len(built)}"

    key = ("test_preamble", 1)
    assert pre._cached_table(key, (ids,), build) == "table1"
    assert pre._cached_table(key, (ids.clone(),), build) == "table1"  # same contents
    ids[2] = 0
    assert pre._cached_table(key, (ids,), build) == "table2"


def test_a_scalar_bound_in_a_forward_tile_mask_runs_interpreted(tmp_path: Path) -> None:
    """`rel[h % Hq, q_idx - kv_idx + N - 1]` puts a scalar test (h % Hq < Hq) into a tile's load mask: the
    interpreter's splat of that boolean (fixed in the preamble) must keep it boolean in forward modules too."""
    p = forward("rel_mod_fwd", score_mod="score + rel[h % Hq, q_idx - kv_idx + N - 1]",
                aux=(Param("rel", ("Hq", "R"), Dtype.F32, Role.AUX),))
    g = torch.Generator().manual_seed(3)
    ins = {n: torch.randn(1, 2, 21, 16, generator=g) for n in ("q", "k", "v")}
    ins["rel"] = torch.randn(2, 41, generator=g)
    ins["sm_scale"] = 0.25
    want, got = run_program(p, ins), TritonKernel.from_program(p, tmp_path).run(ins)
    torch.testing.assert_close(got["o"], want["o"], atol=1e-5, rtol=1e-5)


def test_a_first_call_inside_a_cuda_graph_capture_runs_the_programs_own_design(monkeypatch: pytest.MonkeyPatch) -> None:
    """No trial launch or timing may happen inside a capture (both would be captured or would synchronise): the
    program's own design runs and nothing is kept, so the next call outside a capture still chooses."""
    monkeypatch.setattr(pre, "PROGRAM", "p", raising=False)
    monkeypatch.setattr(pre, "PROGRAM_DESIGN", (64, 64, 1, 4, 2, True, False), raising=False)
    monkeypatch.setattr(pre, "DESIGNS", {"sm90": {128: [(128, 128, 1, 8, 3, True, False)]}}, raising=False)
    monkeypatch.setattr(pre, "_interpreting", lambda t: False)
    monkeypatch.setattr(pre.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pre.torch.cuda, "is_current_stream_capturing", lambda: True)

    def launch(design: tuple) -> None:
        raise AssertionError(f"launched {design} inside the capture")

    key = ("cuda", "bf16", 1, 2, 3)
    assert pre._choose_design(torch.empty(1), 128, key, launch) == (64, 64, 1, 4, 2, True, False)
    assert pre._shape_bucket(key) not in pre._PICKED and key not in pre._PICKED
