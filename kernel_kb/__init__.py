"""kernel-kb from Python: `kernel_kb.load(SPEC | KERNEL_ID | OUT_DIR)` returns a generated kernel module, ready to call.

    import kernel_kb
    mod = kernel_kb.load("specs/alibi.py")       # generates on a cache miss, else takes the cached kernel
    o = mod.ModelNew(*init_inputs)(q, k, v)       # or mod.forward(q, k, v, ...) -> (o, lse)

The logic lives in generate.load and generate.cache (this package is the public facade above them).
"""

from generate.load import load
from kb.errors import KBError

__all__ = ["KBError", "load"]
