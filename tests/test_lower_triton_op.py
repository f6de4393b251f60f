"""Generated modules as PyTorch operators (kb.lower.triton_op) and their launch plans, on CPU (Triton interpreter).

What a user does with a generated kernel inside a model: torch.compile it with fullgraph=True and train (outputs and
gradients equal eager, a learnable table included), vary the sequence length (no recompile per length), call it
without gradients (no dispatcher), ask a forward-only kernel for a backward (a clear error, never None gradients),
import it twice (one operator), and call it again and again (the launch plan replays the first call)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below (as the lowering tests run)

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch._dynamo.testing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

from generate.candidate import write_candidate
from generate.spec_trace import aux_name
from kb.errors import KBError
from kb.ir.nodes import Role
from kb.ir.text import parse_program, print_program
from kb.lower import triton_preamble as pre
from kb.lower.runtime import load_module
from kb.lower.triton import lower_program
from kb.lower.triton_bwd import lower_autograd
from kb.lower.triton_op import NO_BACKWARD_DEFAULT, with_backward_reason
from tests.support.backward import CLASSES, SPECS, transferred_programs
from tests.support.ir_programs import FIXTURES, causal_bwd
from verify import Verdict, VerifyOptions, verify


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("triton_op_cache")


@pytest.fixture(scope="module")
def learnable(tmp_path_factory: pytest.TempPathFactory):
    """(spec module, candidate module): the rule engine's forward + backward of a spec with a learnable relative-bias
    table, written as kb generate writes it (ModelNew calls kb_attention)."""
    spec, fwd, bwd, _ = transferred_programs(CLASSES["relative_bias_learnable"])
    aux = [q.name for q in fwd.params if q.role is Role.AUX]
    files = write_candidate(spec, lower_autograd(fwd, bwd), aux, tmp_path_factory.mktemp("cand"), "rel")
    return _import(SPECS / CLASSES["relative_bias_learnable"]), _import(files.candidate)


def _import(path: Path, name: str | None = None) -> ModuleType:
    """Import a file as a module registered in sys.modules (Dynamo looks a traced function's module up there)."""
    name = name or f"{path.stem}_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


class _Net(torch.nn.Module):
    """A projection before the attention and a loss after it: the kernel inside a model, as users call it."""

    def __init__(self, attention: torch.nn.Module, d: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d)
        self.attention = attention

    def forward(self, q, k, v):
        return self.attention(self.proj(q), k, v)


def _inputs(spec_mod: ModuleType, seed: int, length: int | None = None) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    ins = [t.float() for t in spec_mod.get_inputs()]
    if length is not None:
        ins = [torch.randn(*t.shape[:2], length, t.shape[3]) for t in ins]
    return [t.requires_grad_() for t in ins]


def _grads(net: torch.nn.Module, ins: list[torch.Tensor], dout: torch.Tensor) -> tuple[torch.Tensor, list]:
    for p in (*ins, *net.parameters()):
        p.grad = None
    out = net(*ins)
    out.backward(dout)
    return out.detach(), [t.grad.clone() for t in ins] + [p.grad.clone() for p in net.parameters()]


def test_compiled_fullgraph_model_trains_like_eager(learnable) -> None:
    """torch.compile(fullgraph=True) (Inductor) of a model calling the generated kernel: the same outputs and gradients
    of q, k, v, the projection and the learnable bias table as eager; Dynamo sees one op, never the host code."""
    spec_mod, cand = learnable
    torch.manual_seed(0)
    net = _Net(cand.ModelNew(*spec_mod.get_init_inputs()), spec_mod.get_inputs()[0].shape[-1])
    ins = _inputs(spec_mod, 1)
    dout = torch.randn(net(*ins).shape)
    out_eager, grads_eager = _grads(net, ins, dout)
    assert all(g.abs().sum() > 0 for g in grads_eager)  # the table's gradient included
    compiled = torch.compile(net, fullgraph=True)
    out_compiled, grads_compiled = _grads(compiled, ins, dout)
    torch.testing.assert_close(out_compiled, out_eager, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads_compiled, grads_eager):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dynamic_lengths_do_not_recompile_per_length(learnable) -> None:
    """The fake implementation sizes outputs from symbolic shapes: after the first length change Dynamo marks the
    length dynamic, and further lengths reuse that graph."""
    spec_mod, cand = learnable
    model = cand.ModelNew(*spec_mod.get_init_inputs())
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for length in (40, 57, 23, 31):
        ins = [t.detach() for t in _inputs(spec_mod, length, length)]
        torch.testing.assert_close(compiled(*ins), model(*ins), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 2, counter.frame_count  # one static graph, then one dynamic for every length
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for length in (40, 57, 23):
        ins = [t.detach() for t in _inputs(spec_mod, length, length)]
        torch.testing.assert_close(compiled(*ins), model(*ins), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1, counter.frame_count  # dynamic from the start: one graph


def test_forward_only_kernel_raises_on_backward(cache_dir: Path) -> None:
    """A module without a backward still gives outputs a grad_fn, and its backward says why there is none."""
    src = with_backward_reason(lower_program(FIXTURES["causal"]()), "kb generate built none: --no-backward")
    mod, _ = load_module(src, "op_fwd_only", cache_dir)
    q, k, v = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(3))
    out = mod.kb_attention(q, k, v)
    assert out.grad_fn is not None
    with pytest.raises(NotImplementedError, match="has no backward: kb generate built none: --no-backward"):
        out.sum().backward()
    compiled = torch.compile(lambda q, k, v: mod.kb_attention(q, k, v), backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)  # compiling traces the backward with the fake implementation; running it raises
    with pytest.raises(NotImplementedError, match="has no backward"):
        out.sum().backward()
    with torch.no_grad():
        assert mod.kb_attention(q, k, v).grad_fn is None  # inference needs no backward


def test_verifier_says_no_backward_with_the_reason(tmp_path: Path) -> None:
    """`kb verify --backward` on a forward-only candidate: no_backward, naming why (never a pass on None gradients)."""
    spec, fwd, _, _ = transferred_programs(CLASSES["relative_bias_learnable"])
    aux = [q.name for q in fwd.params if q.role is Role.AUX]
    src = with_backward_reason(lower_program(fwd), "kb generate built none: --no-backward")
    files = write_candidate(spec, src, aux, tmp_path, "fwd_only")
    res = verify(SPECS / CLASSES["relative_bias_learnable"], files.candidate,
                 VerifyOptions(backward=True, distributions=("normal",), max_cases=1, timeout_s=600))
    assert res.verdict is Verdict.no_backward and "has no backward: kb generate built none" in res.message, res.message


def test_default_reason_and_its_replacement() -> None:
    src = lower_program(FIXTURES["causal"]())
    assert f"NO_BACKWARD = {NO_BACKWARD_DEFAULT!r}" in src
    why = with_backward_reason(src, "why")
    assert "NO_BACKWARD = 'why'" in why
    op_name = lambda text: next(x for x in text.splitlines() if x.startswith("OP_NAME = "))  # noqa: E731
    assert op_name(why) != op_name(src)  # another reason, another operator: each raises its own
    assert with_backward_reason(why, NO_BACKWARD_DEFAULT) == src
    with pytest.raises(Exception, match="has a backward"):
        with_backward_reason(lower_autograd(FIXTURES["causal"](), _causal_bwd()), "why")


def _causal_bwd():
    return causal_bwd()


def test_calls_without_gradients_skip_the_dispatcher(cache_dir: Path) -> None:
    mod, _ = load_module(lower_program(FIXTURES["causal"]()), "op_direct", cache_dir)
    calls = []
    op = mod._OP
    mod._OP = lambda *a: calls.append(1) or op(*a)
    try:
        q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
        want = mod.forward(q, k, v)[0]
        torch.testing.assert_close(mod.kb_attention(q, k, v), want)
        assert calls == []  # eager, no gradient: the host function itself
        torch.testing.assert_close(mod.kb_attention(q.requires_grad_(), k, v).detach(), want)
        assert calls == [1]  # a gradient is needed: the operator (its autograd)
    finally:
        mod._OP = op


def test_direct_path_only_for_plain_eager_tensors() -> None:
    t = torch.randn(2)
    assert pre._direct((t, torch.nn.Parameter(torch.randn(2), requires_grad=False)))
    assert not pre._direct((t.requires_grad_(),))
    with torch.no_grad():
        assert pre._direct((t,))

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watch():
        assert not pre._direct((torch.randn(2),))  # a verifier's or profiler's mode sees the operator
    with FakeTensorMode() as fake:
        assert not pre._direct((fake.from_tensor(torch.randn(2)),))


def test_importing_twice_registers_one_operator(cache_dir: Path, tmp_path: Path) -> None:
    src = lower_program(FIXTURES["sliding_window"]())
    path = tmp_path / "sw.py"
    path.write_text(src)
    a, b = _import(path, "sw_a"), _import(path, "sw_b")
    assert a.OP_NAME == b.OP_NAME and a._OP is b._OP
    assert a.OP_NAME.startswith("k_" + a.KERNEL_ID[2:] + "_") and hasattr(torch.ops.kernel_kb, a.OP_NAME)
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    torch.testing.assert_close(a._OP(q, k, v, None)[0], b.forward(q, k, v)[0])
    other = lower_program(FIXTURES["sliding_window"](), designs={"sm90": {16: []}})  # another build of the program
    c, _ = load_module(other, "sw_other", cache_dir)
    assert c.KERNEL_ID == a.KERNEL_ID and c.OP_NAME != a.OP_NAME


def test_operator_fake_sizes_outputs_symbolically(cache_dir: Path) -> None:
    mod, _ = load_module(lower_autograd(FIXTURES["causal"](), _causal_bwd()), "op_fake", cache_dir)
    with FakeTensorMode(shape_env=ShapeEnv()) as fake:
        q = fake.from_tensor(torch.randn(2, 4, 33, 16))
        kv = fake.from_tensor(torch.randn(2, 4, 47, 16))
        o, lse, o_saved = mod._OP(q, kv, kv, None)
        assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        assert o_saved.numel() == 0  # fp32 inputs: o itself is the fp32 O the backward reads
        dq, dk, dv = mod._OP_BWD(q, kv, kv, o, o, lse, None)
        assert dq.shape == q.shape and dk.shape == kv.shape and dv.shape == kv.shape
        qh, kvh = (fake.from_tensor(torch.randn(2, 4, n, 16, dtype=torch.bfloat16)) for n in (33, 47))
        o, _, o_saved = mod._OP(qh, kvh, kvh, None)
        assert o.dtype == torch.bfloat16 and o_saved.shape == qh.shape and o_saved.dtype == torch.float32


def test_bf16_call_stores_o_and_its_fp32_copy_together(cache_dir: Path) -> None:
    """A bf16 call that will need a backward gets o in bf16 and the fp32 O the backward's Δ reads from the same
    store (no conversion kernel after it): o is the copy to within a bf16 unit (the interpreter's cast truncates where
    the GPU's rounds to nearest) and the copy is the kernel's fp32 result, not rounded to bf16."""
    mod, _ = load_module(lower_autograd(FIXTURES["causal"](), _causal_bwd()), "op_o32", cache_dir)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 37, 16).to(torch.bfloat16) for _ in range(3))
    o, lse, o32 = mod._OP(q, k, v, None)
    assert o.dtype == torch.bfloat16 and o32.dtype == torch.float32 and o32.shape == o.shape
    assert ((o.float() - o32).abs() <= o32.abs() * 2.0**-7).all()
    assert not torch.equal(o32, o32.to(torch.bfloat16).float())
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (o32 - ref).abs().max() < 2e-2


# ------------------------------------------------------------------ launch plans


def test_repeated_calls_replay_the_first_calls_launches(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod, _ = load_module(lower_program(FIXTURES["decode_split_kv"]()), "op_plans", cache_dir)
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 70, 16), torch.randn(2, 2, 70, 16)
    want = mod.forward(q, k, v)
    assert len(mod._PLANS) == 1
    monkeypatch.setattr(mod, "_choose_design", lambda *a: pytest.fail("a replayed call decides nothing again"))
    q2, k2, v2 = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 70, 16), torch.randn(2, 2, 70, 16)
    got = mod.forward(q2, k2, v2)
    monkeypatch.undo()
    ref = mod.forward(q2, k2, v2, _design=mod.PROGRAM_DESIGN)  # the same design, planned under its own key
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)
    assert not torch.equal(got[0], want[0])  # new inputs, new outputs: nothing reused but the launches
    mod.forward(q, k[:, :, :50], v[:, :, :50])  # another length: its own plan
    mod.forward(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)  # other strides: its own plan
    assert len(mod._PLANS) == 4
    with pytest.raises(mod.ForwardArgumentError, match="unexpected arguments"):
        mod.forward(q, k, v, bogus=1.0)  # a planned shape with a wrong argument still says what is wrong


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: `kernel[grid](*every argument in signature order)`, where the grid has
    all three axes (Triton reads grid[0], grid[1] and grid[2]; only a JIT launch fills missing ones with 1)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __getitem__(self, grid):
        x, y, z = grid[0], grid[1], grid[2]
        return lambda *args: self.calls.append(("compiled", (x, y, z), args))


class _FakeJit:
    """Stands in for a JITFunction on a GPU: its launch returns the compiled kernel."""

    arg_names = ["x_ptr", "o_ptr", "n", "BLOCK", "EVEN"]

    def __init__(self) -> None:
        self.calls: list = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append(("jit", grid, args, kw))
            return _FakeCompiled(self.calls)
        return run


def test_plans_launch_compiled_kernels_with_every_argument_in_signature_order() -> None:
    fn = _FakeJit()
    x = torch.randn(8)

    def host(x, rec):
        o = pre._kb_alloc(rec, torch.empty, (8,), x.dtype, x.device)
        pre._kb_launch(rec, fn, (3,), (x, o, 8), 4, 2, BLOCK=16, EVEN=True)
        return (o,)

    key = ("fake", 1)
    pre._PLANS.pop(key, None)
    (o,) = pre._kb_planned(key, (x,), lambda rec: host(x, rec))
    assert fn.calls == [("jit", (3,), (x, o, 8), {"BLOCK": 16, "EVEN": True, "num_warps": 4, "num_stages": 2})]
    y = torch.randn(8)
    (o2,) = pre._PLANS.pop(key).replay((y,))
    kind, grid, args = fn.calls[1]
    assert (kind, grid) == ("compiled", (3, 1, 1)) and args[0] is y and args[1] is o2 and args[2:] == (8, 16, True)
    assert o2 is not o and o2.shape == (8,)


def test_aux_names_never_clash_with_the_host_code() -> None:
    """An aux tensor is bound under its own name in the generated host functions: spec tracing renames a captured tensor
    named like the host code's own names, and the lowering refuses a program that still has one."""
    assert [aux_name(n) for n in ("table", "kw", "forward", "max", "_mask", "rel_bias", "q")] == \
        ["table_aux", "kw_aux", "forward_aux", "max_aux", "mask_aux", "rel_bias", "q_aux"]
    clashing = parse_program(print_program(FIXTURES["alibi"]()).replace("slopes", "launch"))
    with pytest.raises(KBError, match=r"aux/scalar param\(s\) \['launch'\] would clash"):
        lower_program(clashing)


def test_model_new_takes_the_state_of_a_model_built_with_other_constructor_arguments(learnable) -> None:
    """ModelNew(8, 80).load_state_dict(Model(8, 80).state_dict()): the table sized by other arguments than generation's
    (4 heads, 64 positions: [4, 127]) is adopted, the kernel computes with it (its `n - 1` offset is N - 1, found by
    tracing the spec at a shorter length too), and its gradient flows to that same Parameter."""
    spec_mod, cand_mod = learnable
    torch.manual_seed(3)
    model, new = spec_mod.Model(8, 80), cand_mod.ModelNew(8, 80)
    table = new.get_parameter("rel")
    new.load_state_dict(model.state_dict())
    assert new.get_parameter("rel") is table and table.shape == (8, 159)
    q, k, v = (torch.randn(1, 8, 80, 64, requires_grad=True) for _ in range(3))
    want, got = model(q, k, v), new(q, k, v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    got.sum().backward()
    assert table.grad is not None and table.grad.shape == (8, 159)
