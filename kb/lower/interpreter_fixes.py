"""Fixes for Triton 3.6's interpreter (TRITON_INTERPRET=1), installed by the processes that run generated kernels on
a CPU: a generated module installs them when it is imported under the interpreter (it imports this module only
then), the verifier's worker and the tests through the modules they load. On a GPU nothing here runs.
"""

from __future__ import annotations

import triton.language as tl

__all__ = ["install"]


def install() -> None:
    """Three Triton 3.6 interpreter bugs, fixed here only when interpreting:
    scalars become ints through int(array of shape (1,)), which NumPy >= 2.4 refuses
    (triton-lang/triton#9171; `range` over runtime bounds needs it); `tl.dot` multiplies
    the raw uint16 storage of bf16 operands; they are widened to fp32 first (exact, as on GPUs);
    and a scalar comparison's handle keeps its operands' type (int32 for `h < Hq`), so splatting it into a tile
    mask (`scalar_test & tile_test`) gives an int32 mask that tl.load and tl.atomic_add refuse: booleans are
    splatted as booleans. And two slow paths that compute nothing (_speed). Idempotent."""
    import numpy as np  # noqa: PLC0415  only when interpreting: verify.child imports this module on GPUs too
    from triton.runtime import interpreter  # noqa: PLC0415  only when interpreting, as numpy

    if getattr(interpreter, "_kb_compat", False):
        return
    _speed(interpreter)
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    create_dot = interpreter.InterpreterBuilder.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    splat = interpreter.InterpreterBuilder.create_splat

    def bool_splat(self, ret_ty, arg):
        if ret_ty.scalar == tl.int1 and arg.data.dtype == np.bool_ and not isinstance(arg.dtype, tl.block_type):
            return interpreter.TensorHandle(np.full(ret_ty.shape, arg.data, dtype=np.bool_), tl.int1)
        return splat(self, ret_ty, arg)

    interpreter._patch_lang_tensor = patched
    interpreter.InterpreterBuilder.create_dot = dot
    interpreter.InterpreterBuilder.create_splat = bool_splat
    interpreter._kb_compat = True


def _speed(interpreter):
    """Two interpreter costs that change no result, skipped (a decode kernel's CPU check ran 2-4x slower with them):
    - every integer +, -, * builds an int64 overflow check through the semantic layer whose only effect is a
      device_assert, which the interpreter drops unless debugging (options.debug); it now runs only then;
    - every call of a @triton.jit helper (tl.cdiv, tl.max, tl.sum, ...) re-patched triton.language with
      inspect.getmembers; within one grid run, modules already patched for it are not patched again."""
    semantic = interpreter.interpreter_semantic
    sanitize = semantic.binary_op_sanitize_overflow_impl

    def overflow_check(lhs, rhs, binary_op):
        if semantic.builder.options.debug:
            sanitize(lhs, rhs, binary_op)

    semantic.binary_op_sanitize_overflow_impl = overflow_check
    patch_lang, grid_call, patched = interpreter._patch_lang, interpreter.GridExecutor.__call__, []

    class _Kept:
        def restore(self):
            pass

    def lang_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if patched and langs <= patched[-1]:
            return _Kept()  # already patched in this grid run (device-function scopes are never restored anyway)
        scope = patch_lang(fn)
        if patched:
            patched[-1].update(langs)
        return scope

    def run_grid(self, *args, **kwargs):
        patched.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = lang_once
    interpreter.GridExecutor.__call__ = run_grid
