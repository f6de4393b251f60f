"""Dynamic checks around one candidate call: forbidden torch ops, reference calls, threads.

`CallGuard` is a context manager; after the block `violation` holds the first problem:
- forbidden_call: an aten compute op an attention kernel must not use (matmul, softmax
  and SDPA families), seen by a `TorchDispatchMode` at the aten level so Tensor methods,
  `@`, `F.*` and `torch.*` are all caught; and, as an emulation catch, any torch op whose
  output is `MATERIALISE_FACTOR` times larger than every input and the expected output
  (e.g. `(q[..., None, :] * k[..., None, :, :]).sum(-1)`), data movement excepted
  (`DATA_MOVEMENT_OPS`). Skipped in torch-baseline mode.
- operators outside aten: a `torch.library.custom_op` (as every generated kernel is) is run by the guard inside
  its mode, so the torch ops of its Python implementation are judged like the candidate's own; an operator of any
  other namespace with no Python implementation is forbidden_call "opaque_op" (strict mode).
- hack_suspected "side_stream" (CUDA): a torch op ran on a stream other than the caller's.
- hack_suspected: a module whose forward is defined in the spec file was called (the
  reference Model, in either mode), or a thread was started.
The Triton interpreter only uses allocation/copy ops (empty, copy_, set_), never these.

`phase="backward"` guards the harness's `torch.autograd.grad` call on the candidate's output, so
every rule above also holds inside the candidate's backward (the dispatch mode travels with the
autograd engine's thread-local state into its worker threads). Two more rules there, strict mode only:
- forbidden_call "autograd_in_backward": a torch compute op that records an autograd graph (grad
  mode on and a tensor argument requiring grad), i.e. the backward re-runs a computation under
  `torch.enable_grad()` to have torch differentiate it;
- forbidden_call "nested_autograd": the autograd engine entered again while the harness's backward
  runs (`torch.autograd.grad`, `Tensor.backward`, `torch.autograd.functional`, `torch.func`
  transforms all reach it), seen by wrapping `Variable._execution_engine` for the call.
"""

from __future__ import annotations

import _thread
import os
import threading
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch._library.custom_ops import _maybe_get_opdef  # the registry custom_op keeps (no public accessor)
from torch.autograd.variable import Variable
from torch.nn.modules.module import register_module_forward_pre_hook

from verify.dispatch_mode import WatchMode, undynamoed
from verify.result import Verdict

__all__ = ["CallGuard", "Violation", "forbidden_op", "FORBIDDEN_OPS", "FORBIDDEN_PREFIXES", "PHASES", "TRANSPARENT_NAMESPACES"]

PHASES = ("forward", "backward")

FORBIDDEN_OPS = frozenset({
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "dot", "vdot", "mv", "addmv", "linear", "einsum",
    "tensordot", "_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax", "special_softmax",
    "scaled_dot_product_attention", "_int_mm", "_scaled_mm",
})
FORBIDDEN_PREFIXES = ("_scaled_dot_product", "scaled_dot_product", "_flash_attention", "_efficient_attention",
                      "_cudnn_attention", "_fused_sdp")
MATERIALISE_FACTOR = 4
# operator namespaces whose ops the guard judges by name (aten, prims) or that compute nothing (profiler's markers);
# an op of any other namespace runs code the harness must see: a Python custom_op is watched inside, any other op is
# forbidden (strict mode), since its C++ or foreign implementation could compute attention out of sight
TRANSPARENT_NAMESPACES = frozenset({"aten", "prims", "profiler"})
# Ops that move or fill memory without computing from it: the Triton interpreter copies every kernel
# argument back through them (a split-KV kernel's partial outputs are NUM_SPLITS times the output), and
# none of them can produce a score matrix without a compute op that the size check still sees.
# So scratch is told apart from a materialised score matrix by how it is filled, not by its size: honest
# scratch (split-KV partials, O(output x NUM_SPLITS); block tables) is allocated (factories take no tensor,
# so they are never size-checked) and written by the kernel; a torch compute op producing more than
# MATERIALISE_FACTOR x the largest input or output is caught whatever buffer it writes, `out=` scratch
# included (tests/cheats/scores_in_scratch.py). Peak memory bounds the rest (verify.memory).
DATA_MOVEMENT_OPS = frozenset({"set_", "copy_", "fill_", "zero_", "detach", "alias", "_to_copy", "clone",
                               "empty_like", "new_empty", "new_empty_strided", "lift_fresh"})


@dataclass(frozen=True)
class Violation:
    verdict: Verdict
    op: str
    message: str


def forbidden_op(func: Any) -> str | None:
    """The aten op's name if it belongs to a forbidden family, else None."""
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    if name in FORBIDDEN_OPS or name.startswith(FORBIDDEN_PREFIXES):
        return str(func)
    return None


class _OpWatch(WatchMode):
    def __init__(self, guard: "CallGuard") -> None:
        super().__init__()
        self.guard = guard

    def dispatch(self, func, types, args=(), kwargs=None):
        g = self.guard
        if g.strict and g.violation is None and g.phase == "backward" and _records_graph(func, args, kwargs):
            g.violation = Violation(
                Verdict.forbidden_call, "autograd_in_backward",
                f"{func} recorded an autograd graph inside the candidate's backward (torch ops under enable_grad): "
                "gradients must come from the candidate's own kernels, not from torch autograd on a re-computation")
        impl = _python_impl(func, args)
        if impl is not None:  # an operator defined in Python (torch.library.custom_op): watch what it runs
            with self:
                out = impl(*args, **(kwargs or {}))
        else:
            if g.strict and g.violation is None and getattr(func, "namespace", "aten") not in TRANSPARENT_NAMESPACES:
                g.violation = Violation(Verdict.forbidden_call, "opaque_op",
                                        f"candidate called {func}, an operator whose implementation the harness cannot "
                                        "watch; register kernels with torch.library.custom_op (Python) so it can")
            out = func(*args, **(kwargs or {}))
        if g.stream is not None and g.violation is None and torch.cuda.current_stream() != g.stream:
            g.violation = Violation(Verdict.hack_suspected, "side_stream",
                                    f"{func} ran on a side stream; work must run on the caller's stream")
        if g.strict and g.violation is None:
            name = forbidden_op(func)
            if name:
                g.violation = Violation(Verdict.forbidden_call, name, f"candidate called {name} inside {g.phase}")
            elif g.max_numel and _has_tensor(args) and isinstance(out, torch.Tensor) and out.numel() > g.max_numel \
                    and getattr(func, "overloadpacket", func).__name__ not in DATA_MOVEMENT_OPS:
                g.violation = Violation(
                    Verdict.forbidden_call, str(func),
                    f"{func} produced a tensor of {out.numel()} elements, over {MATERIALISE_FACTOR}x any input or "
                    "the output: a torch op emulating matmul/softmax (score matrix materialised in torch)")
        return out


def _python_impl(func: Any, args: Any) -> Any:
    """The Python function a `torch.library.custom_op` runs for these arguments' device, or None (an aten op, or an
    operator with no Python implementation). A dispatch mode sees such an operator as one call and is left while it
    runs, so the guard runs this function itself, inside the mode, to see the torch ops it calls."""
    if getattr(func, "namespace", "aten") in TRANSPARENT_NAMESPACES:
        return None
    opdef = _maybe_get_opdef(func)
    if opdef is None:
        return None
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    fns = opdef._backend_fns
    impl = fns.get(device) or fns.get(None)
    return None if impl is None else undynamoed(impl)


def _has_tensor(args: Any) -> bool:
    return any(isinstance(a, torch.Tensor) for a in args)


def _records_graph(func: Any, args: Any, kwargs: Any) -> bool:
    """Grad mode is on and a tensor argument requires grad: autograd records this op (data movement aside)."""
    if not torch.is_grad_enabled() or getattr(func, "overloadpacket", func).__name__ in DATA_MOVEMENT_OPS:
        return False
    flat = list(args) + list((kwargs or {}).values())
    flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat)


class _EngineWatch:
    """Stands in for `Variable._execution_engine` during a guarded backward: counts how deep
    `run_backward` is entered; a second level is the candidate's backward calling autograd."""

    def __init__(self, engine: Any, guard: "CallGuard") -> None:
        self._engine, self._guard, self._depth = engine, guard, 0

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        g = self._guard
        if self._depth > 0 and g.violation is None:
            g.violation = Violation(Verdict.forbidden_call, "nested_autograd",
                                    "the candidate's backward called torch autograd (torch.autograd.grad / "
                                    "Tensor.backward): gradients must come from its own kernels")
        self._depth += 1
        try:
            return self._engine.run_backward(*args, **kwargs)
        finally:
            self._depth -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class CallGuard:
    """Watch one candidate call. `strict` False is torch-baseline mode (torch compute allowed).

    phase: "forward" (the call of ModelNew) or "backward" (the harness's autograd call on its output;
    `inputs` then also holds dO, `expected_numel` the output's size)."""

    def __init__(self, strict: bool, spec_file: str, inputs: list[Any], expected_numel: int,
                 phase: str = "forward") -> None:
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        self.strict, self.phase = strict, phase
        self.spec_file = os.path.realpath(spec_file)
        sizes = [x.numel() for x in inputs if isinstance(x, torch.Tensor)] + [expected_numel]
        self.max_numel = MATERIALISE_FACTOR * max(sizes)
        self.violation: Violation | None = None
        self.stream = torch.cuda.current_stream() if any(
            isinstance(x, torch.Tensor) and x.is_cuda for x in inputs) else None
        self._mode = _OpWatch(self)

    # -- reference calls: any nn.Module defined in the spec file (however it was imported).
    # A global module hook, not sys.setprofile: profiling every Python call slows the
    # Triton interpreter 3-6x. Direct `Model.forward(...)` calls are the static scan's job.
    def _module_call(self, module: torch.nn.Module, args: Any) -> None:
        code = getattr(type(module).forward, "__code__", None)
        if self.violation is None and code is not None and os.path.realpath(code.co_filename) == self.spec_file:
            self.violation = Violation(Verdict.hack_suspected, "calls_reference",
                                       f"candidate called the spec's {type(module).__name__} ({self.spec_file})")

    # -- threads: patch both the threading API and the raw _thread one for the call
    def _thread_started(self, what: str) -> None:
        if self.violation is None or self.violation.verdict is not Verdict.forbidden_call:
            self.violation = Violation(Verdict.hack_suspected, "background_thread",
                                       f"candidate started a thread ({what}) inside {self.phase}; "
                                       "work must finish before it returns")

    def __enter__(self) -> "CallGuard":
        self._threads_before = set(threading.enumerate())
        self._orig_start, self._orig_raw = threading.Thread.start, _thread.start_new_thread
        guard = self

        def start(self: threading.Thread) -> None:  # named as Thread.start's parameter, which it replaces
            guard._thread_started(self.name)
            return guard._orig_start(self)

        def raw(*a: Any, **k: Any) -> Any:
            guard._thread_started("_thread.start_new_thread")
            return guard._orig_raw(*a, **k)

        threading.Thread.start = start  # type: ignore[method-assign]
        _thread.start_new_thread = raw
        self._hook = register_module_forward_pre_hook(self._module_call)
        self._engine = Variable._execution_engine
        if self.strict and self.phase == "backward":
            # a duck-typed stand-in: it forwards everything but run_backward to the engine it wraps
            Variable._execution_engine = cast("torch._C._ImperativeEngine", _EngineWatch(self._engine, self))
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        Variable._execution_engine = self._engine
        self._hook.remove()
        threading.Thread.start = self._orig_start  # type: ignore[method-assign]
        _thread.start_new_thread = self._orig_raw
        extra = [t for t in threading.enumerate() if t not in self._threads_before]
        if self.phase == "backward":  # autograd's own device threads show up as dummies once they run Python
            extra = [t for t in extra if not isinstance(t, threading._DummyThread)]
        if extra and self.violation is None:
            self._thread_started(extra[0].name)
