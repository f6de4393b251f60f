"""The fp32 reference: the spec's Model on the candidate's (possibly low-precision) inputs upcast.

TF32 is off while it runs, so fp32 matmuls on a GPU are true fp32.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

__all__ = ["reference_output", "tf32", "upcast"]


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """Set TF32 for matmul and cuDNN inside the block, restoring the previous values."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def upcast(inputs: list[Any]) -> list[Any]:
    return [x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]


def reference_output(model: nn.Module, inputs: list[Any]) -> torch.Tensor:
    """Model(*inputs) in fp32 with TF32 off; `model` must already be in fp32."""
    with torch.no_grad(), tf32(False):
        out = model(*upcast(inputs))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"spec Model returned {type(out).__name__}; verify compares one output tensor")
    return out.float()
