"""The emitted module behaves like a library kernel: it picks a design per GPU and shape (the fastest of its listed
designs, timed once per shape bucket), survives a design that does not fit, times its designs once on a GPU it has no
entry for, and answers in the input dtype."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch
import triton
import triton.testing

from kb.ir.design import AUTO_SPLITS, Design
from kb.ir.nodes import Dtype
from kb.lower.runtime import load_module
from kb.lower.triton import LowerOptions, lower_program
from tests.support.attn_reference import reference_attention
from tests.support.ir_programs import FIXTURES

TABLE = {"sm90": {64: (Design(128, 64, 4, 3), Design(64, 64, 4, 3))},
         "sm80": {64: (Design(64, 32, 4, 2),)}}


def _module(name: str = "causal", dtype: Dtype = Dtype.F32, tag: str = ""):
    p = FIXTURES[name](dtype=dtype)
    return p, load_module(lower_program(p, designs=TABLE), f"designs_{name}{tag}")[0]


def _qkv(dtype: torch.dtype, M: int = 37, N: int = 37, D: int = 24, Hkv: int = 2):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, s, n, D, generator=g).to(dtype) for s, n in ((2, M), (Hkv, N), (Hkv, N))]


def test_every_design_computes_the_same_attention() -> None:
    p, mod = _module()
    q, k, v = _qkv(torch.float32)
    ref, lse_ref = reference_attention(p, q, k, v)
    for design in (mod.PROGRAM_DESIGN, (32, 16, 1, 4, 1, False), (16, 32, 1, 2, 3, True)):
        o, lse = mod.forward(q, k, v, _design=design)
        torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)


def test_split_count_chosen_at_launch_is_correct() -> None:
    p, mod = _module("decode_split_kv")
    q, k, v = _qkv(torch.float32, M=3, N=45, D=16)
    ref, _ = reference_attention(p, q, k, v)
    for splits in (AUTO_SPLITS, 2, 5):
        o, _ = mod.forward(q, k, v, _design=(16, 16, splits, 4, 1, False))
        torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_follow_the_input_dtype(dtype: torch.dtype) -> None:
    p, mod = _module(dtype=Dtype.F32, tag="_dt")  # one module, called with either dtype
    q, k, v = _qkv(dtype)
    o, lse = mod.forward(q, k, v)
    assert o.dtype == dtype and lse.dtype == torch.float32
    ref, _ = reference_attention(p, q.float(), k.float(), v.float())
    torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)


class _FakeGPU:
    """A launch that records designs and refuses the ones a test says do not fit; given the module, it records the
    designs `_compile_designs` builds ahead (its launches then only compile) in `compiled`, apart from `calls`."""

    def __init__(self, too_big: set, mod=None) -> None:
        self.too_big, self.mod, self.calls, self.compiled, self.log = too_big, mod, [], [], []

    def __call__(self, design):
        if self.mod is not None and self.mod._COMPILE_ONLY.get():
            self.compiled.append(design)
            self.log.append(("compile", design))
            return "outputs"
        self.calls.append(design)
        self.log.append(("launch", design))
        if design in self.too_big:
            raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
        return "outputs"


def _as_gpu(mod, monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str = "NVIDIA H200") -> None:
    monkeypatch.setattr(mod, "_interpreting", lambda t: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_listed_gpu_without_timing_runs_the_first_design_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    _, mod = _module(tag="_fit")
    _as_gpu(mod, monkeypatch, (9, 0))
    monkeypatch.setenv("KB_DESIGN_TIMING", "0")
    first, second = TABLE["sm90"][64][0].as_tuple(), TABLE["sm90"][64][1].as_tuple()
    gpu = _FakeGPU({first}, mod)
    t = torch.zeros(1)
    assert mod._choose_design(t, 64, ("k1",), gpu) == second
    assert mod._choose_design(t, 64, ("k1",), gpu) == second and gpu.calls == [first, second]  # chosen once per key
    assert gpu.compiled == [first]  # the first listed is compiled ahead (its kernels together), not the others
    assert mod._choose_design(t, 48, ("k2",), _FakeGPU(set())) == first  # D=48 pads to the 64 bucket


def _timed_gpu(mod, monkeypatch: pytest.MonkeyPatch, fake_ms: dict) -> list:
    """A listed GPU (sm90) whose do_bench answers `fake_ms` per design; returns the list of designs it timed."""
    _as_gpu(mod, monkeypatch, (9, 0))
    timed: list = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: timed.append(fn.__defaults__[0]) or fake_ms[fn.__defaults__[0]])
    return timed


def test_listed_gpu_times_its_listed_designs_once_per_shape_bucket(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """The second listed design measures faster on this shape: it runs. A shape in the same bucket (sizes rounded up
    to powers of two: a longer sequence, 37 -> 50) reuses the timing; a shape in another bucket (200) times again."""
    _, mod = _module(tag="_timed")
    first, second = (d.as_tuple() for d in TABLE["sm90"][64])
    timed = _timed_gpu(mod, monkeypatch, {first: 2.0, second: 1.5})
    gpu = _FakeGPU(set())
    t = torch.zeros(1)
    with caplog.at_level(logging.INFO, logger="kernel_kb.generated"):
        assert mod._choose_design(t, 64, ("cuda", "bf16", 2, 4, 37, 64, 2, 37), gpu) == second
    assert timed == [first, second] and "timed 2 listed designs" in caplog.text
    assert mod._choose_design(t, 64, ("cuda", "bf16", 2, 4, 50, 64, 2, 50), gpu) == second and len(timed) == 2
    assert mod._choose_design(t, 64, ("cuda", "bf16", 2, 4, 200, 64, 2, 200), gpu) == second and len(timed) == 4


def test_timing_skips_what_does_not_fit_and_a_lone_fit_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    _, mod = _module(tag="_timed_fit")
    first, second = (d.as_tuple() for d in TABLE["sm90"][64])
    timed = _timed_gpu(mod, monkeypatch, {first: 1.0, second: 2.0})
    assert mod._choose_design(torch.zeros(1), 64, ("one",), _FakeGPU({first})) == second and timed == []


def test_no_memory_to_time_runs_the_first_design_that_fits(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A model near the GPU's memory limit: do_bench's L2-flush buffer does not fit, the call goes on."""
    _, mod = _module(tag="_timed_oom")
    _as_gpu(mod, monkeypatch, (9, 0))

    def no_memory(fn, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")

    monkeypatch.setattr(triton.testing, "do_bench", no_memory)
    with caplog.at_level(logging.WARNING, logger="kernel_kb.generated"):
        assert mod._choose_design(torch.zeros(1), 64, ("oom",), _FakeGPU(set())) == TABLE["sm90"][64][0].as_tuple()
    assert "no GPU memory left to time designs" in caplog.text


def test_deterministic_modules_do_not_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kb generate --deterministic` lowers with time_designs off: the first listed design that fits runs, every run."""
    p = FIXTURES["causal"](dtype=Dtype.F32)
    src = lower_program(p, LowerOptions(time_designs=False), designs=TABLE)
    assert "\nTIME_DESIGNS = False\n" in src and "\nTIME_DESIGNS = True\n" in lower_program(p, designs=TABLE)
    mod = load_module(src, "designs_causal_untimed")[0]
    first, second = (d.as_tuple() for d in TABLE["sm90"][64])
    timed = _timed_gpu(mod, monkeypatch, {first: 2.0, second: 1.0})
    assert mod._choose_design(torch.zeros(1), 64, ("det",), _FakeGPU(set())) == first and timed == []


def test_unlisted_gpu_times_every_design_once_and_says_so(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    _, mod = _module(tag="_tune")
    _as_gpu(mod, monkeypatch, (8, 9))
    fake_ms = {TABLE["sm90"][64][0].as_tuple(): 2.0, TABLE["sm90"][64][1].as_tuple(): 1.5,
               TABLE["sm80"][64][0].as_tuple(): 1.0, mod.PROGRAM_DESIGN: 3.0}
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fake_ms[fn.__defaults__[0]])
    gpu = _FakeGPU({TABLE["sm80"][64][0].as_tuple()})  # the fastest on paper does not fit
    with caplog.at_level(logging.WARNING, logger="kernel_kb.generated"):
        choice = mod._choose_design(torch.zeros(1), 64, ("shape",), gpu)
    assert choice == TABLE["sm90"][64][1].as_tuple()
    assert "no design measured for sm89 at head dim 64 fits; timed 3 designs" in caplog.text
    assert mod._choose_design(torch.zeros(1), 64, ("shape",), gpu) == choice


def test_interpreter_runs_the_verified_schedule() -> None:
    _, mod = _module(tag="_cpu")
    assert mod._choose_design(torch.zeros(1), 64, ("cpu",), _FakeGPU(set())) == mod.PROGRAM_DESIGN


def test_block_table_is_reused_only_while_the_mask_inputs_are_unchanged() -> None:
    p, mod = _module("document", tag="_table")
    q, k, v = _qkv(torch.float32, M=29, N=29)
    doc = torch.tensor([[0] * 10 + [1] * 19, [0] * 20 + [1] * 9], dtype=torch.int32)
    o1, _ = mod.forward(q, k, v, doc_ids=doc)
    assert len(mod._TABLES) == 1
    mod.forward(q, k, v, doc_ids=doc.clone())  # same contents, another tensor: the table is reused
    assert len(mod._TABLES) == 1
    doc[:, 5:] = 2  # changed in place: same address, same shape, other documents
    o2, _ = mod.forward(q, k, v, doc_ids=doc)
    ref, _ = reference_attention(p, q, k, v, aux={"doc_ids": doc})
    torch.testing.assert_close(o2, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(o1, o2)


def test_a_decode_cache_growing_by_a_token_a_call_chooses_once_per_doubling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a choice served one exact shape, so a KV cache one token longer at every call ran a trial launch (twice
    the work) at every call. Now the lengths 1025..2048 share one choice: no launch but the host's own."""
    _, mod = _module(tag="_grow")
    first, second = (d.as_tuple() for d in TABLE["sm90"][64])
    timed = _timed_gpu(mod, monkeypatch, {first: 1.0, second: 2.0})
    gpu = _FakeGPU(set(), mod)
    for n in range(1025, 1100):
        assert mod._choose_design(torch.zeros(1), 64, ("cuda", "bf16", 8, 16, 1, 64, 2, n), gpu) == first
    # each compiled and tried once, at the first length
    assert gpu.compiled == gpu.calls == [first, second] and timed == [first, second]


def test_listed_designs_are_compiled_together_before_any_is_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first call that times N designs compiles them in one batch of threads (Triton's AsyncCompileMode), then
    tries and times each; a design whose build fails ahead is reported by its own trial launch, as before."""
    _, mod = _module(tag="_compile_ahead")
    first, second = (d.as_tuple() for d in TABLE["sm90"][64])
    _timed_gpu(mod, monkeypatch, {first: 2.0, second: 1.5})
    gpu = _FakeGPU(set(), mod)
    assert mod._choose_design(torch.zeros(1), 64, ("ahead",), gpu) == second
    assert gpu.log[:2] == [("compile", first), ("compile", second)] and gpu.calls == [first, second]
    assert mod._COMPILE_ONLY.get() is False

    class Broken(_FakeGPU):
        def __call__(self, design):
            if design == first:
                raise RuntimeError("cannot build")
            return super().__call__(design)

    with concurrent.futures.ThreadPoolExecutor(1) as pool, triton.AsyncCompileMode(pool):  # a caller's batch: no nesting
        mod._PICKED.clear()
        gpu = _FakeGPU(set(), mod)
        assert mod._choose_design(torch.zeros(1), 64, ("ahead",), gpu) == second and gpu.compiled == []

    _, mod2 = _module(tag="_compile_broken")
    _timed_gpu(mod2, monkeypatch, {first: 2.0, second: 1.5})
    with pytest.raises(RuntimeError, match="cannot build"):  # raised by the trial launch, not swallowed
        mod2._choose_design(torch.zeros(1), 64, ("broken",), Broken(set(), mod2))
    assert mod2._COMPILE_ONLY.get() is False


def test_a_launch_while_compiling_ahead_only_compiles() -> None:
    """_kb_launch under _compile_designs hands the same arguments, grid and options to Triton's warmup (which, inside
    AsyncCompileMode, submits the compile to the thread pool) and launches nothing."""
    _, mod = _module(tag="_warmup")

    class Kernel:
        def __init__(self) -> None:
            self.warmups: list = []

        def warmup(self, *args, grid, **kw):
            self.warmups.append((args, grid, kw))

        def __getitem__(self, grid):
            raise AssertionError("launched while compiling ahead")

    kernel = Kernel()
    token = mod._COMPILE_ONLY.set(True)
    try:
        mod._kb_launch(None, kernel, (6,), ("q", 3), 4, 2, BLOCK_M=64)
        other: list = []  # another thread meanwhile (a second request, a DataParallel replica) launches as always
        worker = threading.Thread(target=lambda: other.append(mod._COMPILE_ONLY.get()))
        worker.start()
        worker.join()
    finally:
        mod._COMPILE_ONLY.reset(token)
    assert kernel.warmups == [(("q", 3), (6,), {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2})] and other == [False]


def _no_timing(fn, **kw):
    raise AssertionError("timed again: the kept choice was not used")


def test_a_timed_choice_is_kept_for_the_next_process_on_the_same_gpu(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path) -> None:
    """A second process (here: the same module text loaded afresh) runs the design the first one's timing chose,
    after one launch to see that it fits, and times nothing; another GPU, or the first-listed rule, does not use it."""
    monkeypatch.setenv("KB_DESIGN_CACHE_DIR", str(tmp_path / "designs"))
    _, mod = _module(tag="_keep_a")
    first, second = (d.as_tuple() for d in TABLE["sm90"][64])
    key = ("cuda", "bf16", 2, 4, 300, 64, 2, 300)
    _timed_gpu(mod, monkeypatch, {first: 2.0, second: 1.5})
    assert mod._choose_design(torch.zeros(1), 64, key, _FakeGPU(set())) == second
    (kept,) = (tmp_path / "designs").iterdir()
    assert kept.name == mod.OP_NAME + ".json" and "NVIDIA H200" in kept.read_text()

    _, later = _module(tag="_keep_b")
    _as_gpu(later, monkeypatch, (9, 0))
    monkeypatch.setattr(triton.testing, "do_bench", _no_timing)
    gpu = _FakeGPU(set(), later)
    assert later._choose_design(torch.zeros(1), 64, key, gpu) == second and gpu.compiled == gpu.calls == [second]

    _, other = _module(tag="_keep_c")
    _as_gpu(other, monkeypatch, (9, 0), name="NVIDIA H100 80GB HBM3")
    timed = _timed_gpu(other, monkeypatch, {first: 1.0, second: 1.5})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert other._choose_design(torch.zeros(1), 64, key, _FakeGPU(set())) == first and timed == [first, second]

    _, untimed = _module(tag="_keep_d")
    _as_gpu(untimed, monkeypatch, (9, 0))
    monkeypatch.setenv("KB_DESIGN_TIMING", "0")
    assert untimed._choose_design(torch.zeros(1), 64, key, _FakeGPU(set())) == first


def test_a_choices_file_is_data_what_the_module_does_not_list_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                                          caplog) -> None:
    """A kept design the module does not list (a file edited or written by someone else) is not launched, an
    unreadable file is reported and replaced whole, and a choice made without timing (no memory to time) is not kept."""
    monkeypatch.setenv("KB_DESIGN_CACHE_DIR", str(tmp_path))
    _, mod = _module(tag="_kept_data")
    first, second = (d.as_tuple() for d in TABLE["sm90"][64])
    _timed_gpu(mod, monkeypatch, {first: 2.0, second: 1.5})
    key = ("cuda", "bf16", 1, 1, 64)
    kept = f"call|NVIDIA H200|triton {triton.__version__}|{mod._shape_bucket(key)!r}"
    path = tmp_path / f"{mod.OP_NAME}.json"
    path.write_text(json.dumps({"choices": {kept: [256, 256, 1, 32, 9, True, False]}}))
    gpu = _FakeGPU(set())
    assert mod._choose_design(torch.zeros(1), 64, key, gpu) == second and (256, 256, 1, 32, 9, True, False) not in gpu.calls
    assert json.loads(path.read_text())["choices"][kept] == list(second)

    mod._PICKED.clear()
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kernel_kb.generated"):
        assert mod._choose_design(torch.zeros(1), 64, key, _FakeGPU(set())) == second
    assert "ignoring the design choices in" in caplog.text and json.loads(path.read_text())["choices"][kept]

    def no_memory(fn, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(triton.testing, "do_bench", no_memory)
    mod._PICKED.clear()
    assert mod._choose_design(torch.zeros(1), 64, ("cuda", "bf16", 9, 9, 9), _FakeGPU(set())) == first
    assert len(json.loads(path.read_text())["choices"]) == 1
