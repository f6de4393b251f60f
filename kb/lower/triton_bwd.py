"""Backward Program -> Triton module: the kernels (kb.lower.triton's generator) and a host `backward`, and the
autograd glue that pairs a forward module with it.

A backward program (`kb.ir.nodes.is_backward`) takes q, k, v, o, dout, lse (+ aux tensors, scalars) and writes
dq, dk, dv (+ the gradient of each learnable aux tensor an `aux_grad` targets). Its module has:
- the kernels, one `@triton.jit` function per IR kernel, in the KV-outer FlashAttention-2 shape the IR gives
  (k, v, dk, dv tiles in registers, `store ... +=` as fp32 atomics, P and dS cast to the inputs' dtype before
  the tensor-core dots, fp32 accumulation);
- `backward(q, k, v, o, dout, lse, *, sm_scale=None, _design=None, **aux_and_scalars) -> (dq, dk, dv, *aux_grads)`:
  binds dims, zero-fills the accumulated tensors (`accumulated_tensors`), allocates scratch, launches the kernels
  in order with the IR's grids; dq, dk, dv come back in the inputs' dtype, each aux gradient in its aux tensor's
  dtype, in the order `BWD_OUTPUTS` names;
- its own design table and chooser (`BWD_DESIGNS`, `BWD_PROGRAM_DESIGN`, `_choose_bwd_design`: the runtime text of
  kb/lower/triton_bwd_preamble.py, pasted after the forward preamble) and block-class kernel
  (`_bwd_block_class_kernel`), so that everything after the shared preamble (`backward_part`) can be
  appended to a forward module without clashing with its `forward`, `DESIGNS` or `_block_class_kernel`.

`lower_autograd(fwd, bwd)` is that combined module plus its operator section (kb.lower.triton_op): the PyTorch
operator `torch.ops.kernel_kb.<OP_NAME>` with autograd through the backward, and
`kb_attention(q, k, v, *, sm_scale=None, **aux_and_scalars) -> o`, differentiable in q, k, v and in every
learnable aux tensor; `check_pair(fwd, bwd)` says whether the two programs make such a module.
"""

from __future__ import annotations

import dataclasses
import logging

from kb.errors import KBError
from kb.ir.design import DesignTable
from kb.ir.expr import free_vars
from kb.ir.nodes import Probs, Program, Role, accumulated_tensors, aux_gradients, is_backward, walk_stmts
from kb.lower.block_mask import plan_block_mask
from kb.lower.cuda_dispatch import CudaDispatch
from kb.lower.group_grid import spread_group_loops
from kb.lower.preambles import preamble_text
from kb.lower.kernel_gen import check_attention_params
from kb.lower.triton_forward import PREAMBLE, forward_module, kernel_sources, program_signature
from kb.lower.triton_options import LowerOptions
from kb.lower.triton_host import HostEntry, backward_design_lines, check_host_names, class_kernel, host_function, kernel_fn_name
from kb.lower.triton_op import op_section

__all__ = ["lower_backward", "backward_part", "check_pair", "lower_autograd", "BACKWARD_INPUTS", "dq_swap_kernels"]

log = logging.getLogger(__name__)

BACKWARD_INPUTS = ("q", "k", "v", "o", "dout", "lse")  # the `in` params of a backward program, in host order
_GRADS = ("dq", "dk", "dv")
_CLASS_KERNEL = "_bwd_block_class_kernel"

_BWD_PREAMBLE = preamble_text("triton_bwd_preamble.py")  # after the forward preamble, before the kernels


def check_backward_params(p: Program) -> None:
    """KBError (one line) unless `p` is a backward program the Triton lowering can host."""
    if not is_backward(p):
        raise KBError(f"program {p.name} is not a backward program (it has no `probs` statement)")
    check_attention_params(p, "Triton")
    check_host_names(p)
    ins = tuple(q.name for q in p.params if q.role is Role.IN)
    if ins != BACKWARD_INPUTS:
        raise KBError(f"backward program {p.name}: its `in` params must be {', '.join(BACKWARD_INPUTS)} in this order, "
                      f"got {', '.join(ins)}")
    grads = aux_gradients(p)
    outs = [q.name for q in p.params if q.role is Role.OUT]
    if sorted(outs) != sorted((*_GRADS, *grads)):
        raise KBError(f"backward program {p.name}: its `out` params must be dq, dk, dv and the aux_grad targets "
                      f"({', '.join(grads) or 'none'}), got {', '.join(outs)}")


def dq_swap_kernels(p: Program) -> tuple[str, ...]:
    """The kernels a `dq_swap` design launches with BLOCK_M and BLOCK_N exchanged: those that recompute P over a grid
    of query blocks (a separate dq pass), so they hold block_n query rows and step over block_m keys, the transpose of
    the KV-outer dK/dV kernel's tile. Every index, loop bound and block test of a kernel is written in its own
    constexprs, so exchanging them changes the tiling, never the result; a block table (built at one tile shape for
    all kernels) rules it out (backward_part passes none then)."""
    return tuple(k.name for k in p.kernels if any(isinstance(s, Probs) for s in walk_stmts(k.body))
                 and any("BLOCK_M" in free_vars(ax.extent) for ax in k.grid)
                 and not any("BLOCK_N" in free_vars(ax.extent) for ax in k.grid))


def _returns(p: Program) -> tuple[str, ...]:
    """What `backward` returns: dq, dk, dv, then each aux gradient in its aux tensor's dtype."""
    return (*_GRADS, *(f"{g}.to({a}.dtype)" for g, a in aux_gradients(p).items()))


def backward_part(p: Program, options: LowerOptions | None = None, designs: DesignTable | None = None) -> str:
    """Everything of `p`'s module after the shared preamble: appendable to a forward module's source."""
    check_backward_params(p)
    p = spread_group_loops(p)  # a dq pass walking a GQA group: one program per query head
    # no tensor descriptors (TMA) in backward modules: on H200 (bf16, B4 H16 S4K D128) the causal backward ran
    # 2.35 ms without them and 2.83 ms with them at 64x128 w8 s2, 2.87 vs 3.14 ms with a separate dq pass
    opts = dataclasses.replace(options or LowerOptions(), tma=False, warp_specialize=False)
    plan = plan_block_mask(p)
    sig = program_signature(p, opts, plan)
    packs = "backward programs do not pack"
    entry = HostEntry(name="backward", chooser="_choose_bwd_design", class_kernel=_CLASS_KERNEL, table_tag='"bwd", ',
                      zeroed=accumulated_tensors(p), returns=_returns(p), table_helper=False, plans=False,
                      exact_o=False, swap_kernels=() if sig.table else dq_swap_kernels(p))
    out = ["", "", _BWD_PREAMBLE, *kernel_sources(p, sig, plan, opts, packs)]
    if sig.table:
        out += ["", *class_kernel(p, sig, plan, _CLASS_KERNEL)]
    outputs = (*_GRADS, *aux_gradients(p))
    out += ["", *backward_design_lines(p, designs, outputs, opts.time_designs), *host_function(p, sig, plan, packs, entry)]
    return "\n".join(out).rstrip() + "\n"


def lower_backward(p: Program, options: LowerOptions | None = None, designs: DesignTable | None = None) -> str:
    """The source of a standalone module running backward program `p` (host function `backward`)."""
    head = f'"""Triton backward kernels for IR program `{p.name}`: generated by kb.lower.triton_bwd, do not edit."""'
    return "\n".join([head, "", PREAMBLE.rstrip(), backward_part(p, options, designs)]).rstrip() + "\n"


# ------------------------------------------------------------------ autograd


def check_pair(fwd: Program, bwd: Program) -> None:
    if is_backward(fwd):
        raise KBError(f"program {fwd.name} is a backward program; autograd needs the forward first")
    check_backward_params(bwd)
    outs = [q.name for q in fwd.params if q.role is Role.OUT]
    if "o" not in outs or "lse" not in outs:
        raise KBError(f"forward program {fwd.name} must write o and lse (the backward recomputes P from lse); "
                      f"it writes {', '.join(outs)}")
    clash = {kernel_fn_name(k) for k in fwd.kernels} & {kernel_fn_name(k) for k in bwd.kernels}
    if clash:
        raise KBError(f"forward {fwd.name} and backward {bwd.name} both have kernels {sorted(clash)}; rename one side's")
    fwd_takes = {q.name for q in fwd.params if q.role in (Role.AUX, Role.SCALAR)}
    missing = [q.name for q in bwd.params if q.role in (Role.AUX, Role.SCALAR) and q.name not in fwd_takes]
    if missing:
        raise KBError(f"backward {bwd.name} needs {', '.join(missing)}, which forward {fwd.name} does not take")


def lower_autograd(fwd: Program, bwd: Program, options: LowerOptions | None = None,
                   fwd_designs: DesignTable | None = None, bwd_designs: DesignTable | None = None,
                   cuda: CudaDispatch | None = None) -> str:
    """One module: `fwd`'s forward module (with `cuda`, its CUDA dispatch: kb.lower.cuda_dispatch), `bwd`'s kernels and
    host `backward`, and the operator section whose autograd runs them (kb.lower.triton_op)."""
    check_pair(fwd, bwd)
    text = forward_module(fwd, options, fwd_designs, cuda).rstrip() + "\n" + backward_part(bwd, options, bwd_designs)
    return text + op_section(fwd, text, bwd, cuda=bool(cuda), cuda_backward=bool(cuda and cuda.has_backward))
