"""Record a function's pre-dispatch aten ops on real tensors as a torch.fx graph, without make_fx.

torch's `make_fx(fn, pre_dispatch=True)` gives the graph the spec tracer reads (aten ops before autograd's
decompositions: `matmul`, `softmax`, `scaled_dot_product_attention` stay whole), but it imports torch._dynamo
and torch._inductor on every first call, about 1.2 s of a 2-core machine: more than the rest of a first-time
`kb query SPEC`. `record_graph` builds the same graph with one dispatch mode in the pre-dispatch slot:

- each input is a placeholder; a tensor the function reads that no op made (a parameter, buffer or global) is
  a `get_attr` constant holding that very tensor object (the tracer maps state by identity);
- each op is a `call_function` node whose `meta["val"]` has the result's shape and dtype (a tuple result gets one
  `operator.getitem` node per tensor element); an in-place op's node stands for its tensor from then on;
- `torch.tensor(...)`'s `lift_fresh` is recorded as `lift_fresh_copy` of a constant, as make_fx does;
- a data-dependent op (`.item()`, `int(t)`, Python `if` on a tensor) on a tensor that came from the inputs
  raises RuntimeError naming "data-dependent", as make_fx does in real mode; on constants it just runs;
- `meta["stack_trace"]` lists the frames outside torch and this module, for error messages.

`tests/test_spec_fx.py` checks the graphs equal make_fx's over every spec and mod the repository ships.
"""

from __future__ import annotations

import inspect
import operator
import os
import traceback
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["record_graph"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_aten = torch.ops.aten


class _Recorder(ProxyTorchDispatchMode):
    """The pre-dispatch slot takes only torch's own mode types, hence the base class; none of its state is
    used (its __init__, which imports torch._inductor for one flag, is not called)."""

    def __init__(self, graph: torch.fx.Graph, root: torch.nn.Module) -> None:
        TorchDispatchMode.__init__(self, torch._C.DispatchKey.PreDispatch)
        self._mode_key = torch._C._TorchDispatchModeKey.PROXY
        self.enter_stack: list[Any] = []
        self.graph, self.root = graph, root
        # id -> (weak reference, node): a strong one would make torch copy a factory's result into a new tensor
        self.nodes: dict[int, tuple[weakref.ref[torch.Tensor], torch.fx.Node]] = {}
        self.constants: set[int] = set()  # recorded tensors with a known value (see `_constant_result`)
        self.attrs: dict[int, str] = {}  # id of an untracked tensor -> its attribute on the root

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch would wrap __torch_dispatch__ in dynamo.disable, importing torch._dynamo

    def bind(self, t: torch.Tensor, node: torch.fx.Node, constant: bool = False) -> None:
        self.nodes[id(t)] = (weakref.ref(t), node)
        (self.constants.add if constant else self.constants.discard)(id(t))

    def tracked(self, t: torch.Tensor) -> bool:
        hit = self.nodes.get(id(t))
        return hit is not None and hit[0]() is t

    def node_of(self, t: torch.Tensor) -> torch.fx.Node:
        """The node of a recorded tensor; an untracked one is read anew (a get_attr per use, as make_fx does)."""
        if self.tracked(t):
            return self.nodes[id(t)][1]
        name = self.attrs.get(id(t))  # the root keeps t alive: its id stays its own
        if name is None:
            kind = "_param_constant" if isinstance(t, torch.nn.Parameter) else "_tensor_constant"
            name = self.attrs[id(t)] = f"{kind}{sum(1 for n in self.attrs.values() if n.startswith(kind))}"
            setattr(self.root, name, t)
        node = self.graph.get_attr(name)
        node.meta["val"] = _shape_of(t)
        return node

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:
            return func(*args, **kwargs)
        tracked = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and self.tracked(t)]
        all_constant = all(id(t) in self.constants for t in tracked)
        if torch.Tag.data_dependent_output in func.tags or func is _aten.is_nonzero.default:
            if all_constant:
                return func(*args, **kwargs)
            raise RuntimeError(f"It appears that you're trying to get value out of a tracing tensor with {func}: "
                               "this is caused by data-dependent control flow or similar")
        recorded = _aten.lift_fresh_copy.default if func is _aten.lift_fresh.default else func
        node_args, node_kwargs = pytree.tree_map_only(torch.Tensor, self.node_of, (args, kwargs))
        node = self.graph.create_node("call_function", recorded, tuple(node_args), node_kwargs,
                                      name=recorded.overloadpacket.__name__)
        node.meta["stack_trace"] = _user_frames()
        with torch._C._DisablePythonDispatcher():  # the C++ kernels: torch's Python decompositions (matmul's)
            out = func(*args, **kwargs)            # import sympy and symbolic shapes on first use
        node.meta["val"] = pytree.tree_map_only(torch.Tensor, _shape_of, out)
        if isinstance(out, torch.Tensor):
            self.bind(out, node, _constant_result(func, out, tracked, all_constant, self.constants))
        elif isinstance(out, (tuple, list)):
            for i, x in enumerate(out):
                if isinstance(x, torch.Tensor):
                    item = self.graph.create_node("call_function", operator.getitem, (node, i), {})
                    item.meta["val"] = _shape_of(x)
                    self.bind(x, item)
        return out


def _constant_result(func: Any, out: torch.Tensor, tracked: list[torch.Tensor], all_constant: bool,
                     constants: set[int]) -> bool:
    """make_fx's constant propagation: a one-element `torch.tensor(...)`, or a one-element result of a
    deterministic op whose recorded inputs all have known values, one at least; `.item()` of it may run."""
    if out.numel() > 1:
        return False
    if func is _aten.lift_fresh.default:
        return True
    return (torch.Tag.nondeterministic_seeded not in func.tags and all_constant
            and any(id(t) in constants for t in tracked))


def _shape_of(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of t's shape, strides and dtype (make_fx keeps a fake one): `meta["val"]` must not keep
    the value alive."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _user_frames() -> str:
    """The stack, torch's frames and this module's left out, in traceback's format (what make_fx records)."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__]
    return "".join(traceback.format_list(frames))


def _placeholder_names(fn: Callable[..., Any], count: int) -> list[str]:
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [f"{params[i]}_1" if i < len(params) else f"arg{i}_1" for i in range(count)]


def record_graph(fn: Callable[..., Any], inputs: Sequence[Any]) -> torch.fx.GraphModule:
    """`fn(*inputs)` run once on the given (real) values, its aten ops recorded (see module docstring)."""
    graph, root = torch.fx.Graph(), torch.nn.Module()
    rec = _Recorder(graph, root)
    for name, x in zip(_placeholder_names(fn, len(inputs)), inputs):
        node = graph.placeholder(name)
        if isinstance(x, torch.Tensor):
            node.meta["val"] = _shape_of(x)
            rec.bind(x, node)
    with enable_python_dispatcher(), rec:
        out = fn(*inputs)
    result = pytree.tree_map_only(torch.Tensor, rec.node_of, out)
    graph.output(result)
    return torch.fx.GraphModule(root, graph)
