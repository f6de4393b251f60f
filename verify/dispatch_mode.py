"""`WatchMode`: the verifier's base for `TorchDispatchMode`s, which keeps torch._dynamo unimported until something else
imports it.

torch wraps every subclass's `__torch_dispatch__` in `torch._disable_dynamo`, so that dynamo never traces a mode's
handler; that wrapper imports torch._dynamo at its first call, about 1.5 s on 2 cores, which was half of every
verification child's run. Dynamo can trace a frame only once it is imported (its frame hook is installed by
`torch.compile` and friends, which import it first), so the same guarantee holds with a lookup per op: while
torch._dynamo is absent the handler runs as it is, afterwards through `torch._dynamo.disable`. `undynamoed` takes
the same wrapper off a function the handler calls (a `torch.library.custom_op`'s kernel), which the handler's own
`disable(recursive=True)` then covers.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["WatchMode", "undynamoed"]

_DISABLE_DYNAMO_CODE = torch._disable_dynamo(lambda: None).__code__  # the wrapper's code (making one imports nothing)


def undynamoed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` without torch's `_disable_dynamo` wrapper (one layer, only that one), for calls inside a WatchMode."""
    if getattr(fn, "__code__", None) is _DISABLE_DYNAMO_CODE and hasattr(fn, "__wrapped__"):
        return fn.__wrapped__
    return fn


class WatchMode(TorchDispatchMode):
    """Subclasses implement `dispatch(func, types, args, kwargs)` instead of `__torch_dispatch__`."""

    _undynamo: Callable[..., Any] | None = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's wrapper is replaced by the lazy one in __torch_dispatch__

    def dispatch(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise NotImplementedError

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return self.dispatch(func, types, args, kwargs)
        if self._undynamo is None:
            self._undynamo = dynamo.disable(self.dispatch, recursive=True)
        return self._undynamo(func, types, args, kwargs)
