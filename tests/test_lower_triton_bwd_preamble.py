"""The backward runtime of generated Triton backward modules (kb/lower/triton_bwd_preamble.py): imported and run as a
module, and pasted byte for byte after the forward preamble into what kb.lower.triton_bwd generates."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below (as the lowering tests run)

from pathlib import Path

import pytest
import torch
import triton
import triton.testing

from kb.lower import triton_bwd_preamble as pre
from kb.lower import triton_preamble as fwd_pre  # `_choose` and what it calls live there (one namespace when pasted)
from kb.lower.triton import PREAMBLE
from kb.lower.triton_bwd import lower_backward
from tests.support.ir_programs import causal_bwd


def test_generated_backward_modules_carry_the_text_after_the_forward_preamble() -> None:
    text = Path(pre.__file__).read_text()
    body = text.split("preamble begins", 1)[1].split("\n", 1)[1].split("# ---- generated modules: preamble ends")[0]
    assert body.startswith("_BWD_PICKED = {}") and body.endswith("\n")
    after = lower_backward(causal_bwd()).split(PREAMBLE.rstrip(), 1)[1]
    assert after.startswith("\n\n\n" + body + "\n\n@triton.jit\n")


def test_interpreter_runs_the_programs_own_schedule_once_per_shape() -> None:
    launched: list[tuple] = []
    key = ("test_bwd_preamble", torch.float32, 1, 2)
    t = torch.empty(1)  # a CPU tensor: the interpreter's case
    assert pre._choose_bwd_design(t, 16, key, launched.append) == pre.BWD_PROGRAM_DESIGN
    pre._BWD_PICKED[key] = (32, 32, 1, 4, 1, False, False)
    assert pre._choose_bwd_design(t, 16, key, launched.append) == (32, 32, 1, 4, 1, False, False)  # cached per key
    assert launched == []  # nothing is timed under the interpreter


def test_a_design_that_does_not_fit_is_skipped() -> None:
    def too_big(design: tuple) -> None:
        raise triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")

    assert fwd_pre._fits(pre.BWD_PROGRAM_DESIGN, lambda design: None, "p")
    assert not fwd_pre._fits(pre.BWD_PROGRAM_DESIGN, too_big, "p")
    with pytest.raises(ValueError):  # anything else is not a fit test's business
        fwd_pre._fits(pre.BWD_PROGRAM_DESIGN, lambda design: int("x"), "p")


def test_longest_first_only_for_a_launch_of_at_most_four_waves(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_longest_first` (HEAVY_FIRST per launch): on a 132-SM GPU, MQA's 256 dK/dV programs yes (measured faster,
    NOTES run 28), 528 yes, 529 and ALiBi's 4096 no (measured slower); off CUDA never."""
    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(pre.torch.cuda, "get_device_properties", lambda device: Props())
    gpu = torch.device("cuda", 0)  # only its type is read; no GPU needed
    assert [pre._longest_first(n, gpu) for n in (256, 528, 529, 4096)] == [True, True, False, False]
    assert pre._longest_first(256, torch.device("cpu")) is False


def test_a_first_backward_inside_a_cuda_graph_capture_runs_the_programs_own_design(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the forward's chooser: no trial launch (it would be captured beside the real one, doubling every replay's
    work) and no timing (it synchronises); the program's own design runs and nothing is kept for the shape."""
    monkeypatch.setattr(pre, "BWD_DESIGNS", {"sm90": {128: [(128, 64, 1, 8, 3, False, False)]}})
    monkeypatch.setattr(fwd_pre, "_interpreting", lambda t: False)
    monkeypatch.setattr(fwd_pre, "_capturing", lambda: True)

    def launch(design: tuple) -> None:
        raise AssertionError(f"launched {design} inside the capture")

    key = ("cuda", "bf16", 1, 2, 3)
    assert pre._choose_bwd_design(torch.empty(1), 128, key, launch) == pre.BWD_PROGRAM_DESIGN
    assert fwd_pre._shape_bucket(key) not in pre._BWD_PICKED and key not in pre._BWD_PICKED


def test_a_listed_gpu_times_the_listed_backward_designs_once_per_shape_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the forward's chooser (one `_timed_choice`): the faster listed design runs; timing off, the first that fits."""
    slow, fast = (128, 64, 1, 8, 3, False, False), (64, 128, 1, 8, 2, False, False)
    monkeypatch.setattr(pre, "BWD_DESIGNS", {"sm90": {128: [slow, fast]}})
    monkeypatch.setattr(fwd_pre, "_interpreting", lambda t: False)
    monkeypatch.setattr(fwd_pre, "_capturing", lambda: False)
    monkeypatch.setattr(fwd_pre.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fwd_pre.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    timed: list[tuple] = []
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, **kw: timed.append(fn.__defaults__[0]) or {slow: 3.0, fast: 2.0}[fn.__defaults__[0]])
    launched: list[tuple] = []
    compiled: list[tuple] = []
    t = torch.empty(1)

    def launch(design: tuple) -> None:  # what _kb_launch does while the designs are compiled ahead: no launch
        (compiled if fwd_pre._COMPILE_ONLY.get() else launched).append(design)

    assert pre._choose_bwd_design(t, 128, ("cuda", "bf16", 4, 16, 4096), launch) == fast
    assert timed == [slow, fast] and launched == [slow, fast]  # each launched once to see that it fits
    assert compiled == [slow, fast]  # after both were compiled together
    assert pre._choose_bwd_design(t, 128, ("cuda", "bf16", 4, 16, 3000), launch) == fast and len(timed) == 2
    monkeypatch.setenv("KB_DESIGN_TIMING", "0")
    assert pre._choose_bwd_design(t, 128, ("cuda", "bf16", 4, 16, 8192), launch) == slow and len(timed) == 2
