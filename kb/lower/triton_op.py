"""The operator section of a generated Triton module: its kernels as one PyTorch operator with autograd.

Every forward module kb.lower.triton writes ends with this section, so that the kernels can sit inside models that
users compile, capture in CUDA graphs and train:
- `torch.ops.kernel_kb.<OP_NAME>(q, k, v, *aux, *scalars, sm_scale) -> (o, lse)` runs the module's `forward`, and
  `torch.ops.kernel_kb.<OP_NAME>_bwd(q, k, v, o, dout, lse, *aux, *scalars, sm_scale) -> (dq, dk, dv, *aux grads)`
  its `backward`. Both are `torch.library.custom_op`s with a fake implementation (output shapes and dtypes from the
  inputs' shapes, never their values, so a dynamic sequence length stays symbolic), so Dynamo and Inductor see two
  opaque ops and never trace the host code or re-compile the Triton source.
- `register_autograd` joins them: the forward saves q, k, v, o, lse and the aux tensors; the backward returns dq, dk, dv
  and the gradient of every learnable aux tensor (an `nn.Parameter` table of the spec). lse is not differentiable.
  A backward that reads an fp32 O (generate.transfer_bwd: Δ = rowsum(dO∘O) as exact as an fp32-math spec's own
  gradient) gets it from a third output: the forward writes O in fp32, returns it in the inputs' dtype as o and
  keeps the fp32 copy (non-differentiable; empty for fp32 inputs) for the backward.
- A module without a backward (a forward-only kernel) still registers both: its `_bwd` raises, when a backward
  actually runs, `NO_BACKWARD` (why there is none and how to get one); gradients are never silently None.
- `torch.ops.kernel_kb.<OP_NAME>_infer(q, k, v, *aux, *scalars, sm_scale) -> (o, lse)` is the forward for calls no
  gradient will be asked of (`torch.no_grad()`, inputs that do not require grad): o in the inputs' dtype, no fp32 copy.
- Every forward goes through `_kb_forward`: `forward()` itself, or, in a module that dispatches to the `.cu` beside it
  (kb.lower.cuda_dispatch; the training forward only where the backward does not need the fp32 O), the `.cu` first
  where `CUDA_FORWARD` lists the GPU and head dim.
- `kb_attention(q, k, v, *, sm_scale=None, **aux_and_scalars) -> o` is what users and `ModelNew` call: the operator when
  a gradient may be asked for, else the inference operator, whose function an eager call (preamble `_direct`) runs
  itself, skipping the dispatcher.

OP_NAME is `k_<16 hex of the forward program's KB id>_<8 hex of the module text above this section>`: the KB id says
which kernel it is (`kb show k-...`), the digest tells builds of one program apart (other designs, with or without a
backward), and a module imported twice (the candidate file and the `_triton.py` beside it hold the same text)
registers once and reuses the operator.
"""

from __future__ import annotations

import hashlib
from string import Template

from kb.errors import KBError
from kb.ir.nodes import Dtype, Param, Program, Role, aux_gradients
from kb.ir.text import content_hash
from kb.lower.triton_host import out_dtype

__all__ = ["NO_BACKWARD_DEFAULT", "op_name", "op_section", "with_backward_reason"]

NO_BACKWARD_DEFAULT = ("no backward kernel was generated with it; `kb generate` on its spec (without --no-backward) "
                       "builds one where it can, and the report's backward.reason says why not")
_NO_BACKWARD_LINE = "NO_BACKWARD = "
_OP_NAME_LINE = "OP_NAME = "
_SECTION_MARKER = "\n\n# ---- PyTorch operator:"


def op_name(fwd: Program, module_text: str, no_backward: str | None) -> str:
    """The operator's name in the `kernel_kb` namespace (see the module docstring): the digest covers the module text
    and why it has no backward, so two modules that differ only in that reason never share an operator."""
    return _name(content_hash(fwd)[:16], module_text, no_backward)


def _name(kernel_hex: str, module_text: str, no_backward: str | None) -> str:
    digest = hashlib.sha256(f"{module_text}\0{no_backward}".encode("utf-8")).hexdigest()[:8]
    return f"k_{kernel_hex}_{digest}"


_SECTION = Template('''

# ---- PyTorch operator: torch.ops.kernel_kb.<OP_NAME> runs forward(), <OP_NAME>_bwd backward(), autograd joins them ----
KERNEL_ID = ${kernel_id}  # the forward program's id in the KB (`kb show`)
OP_NAME = ${op_name}  # the KB id's hex, then this module's digest
${no_backward_line}
_KB_AUX = ${aux}  # the operator's aux tensors, in order after q, k, v
_KB_SCALARS = ${scalars}  # then its float scalars, then sm_scale
_KB_BWD_AUX = ${bwd_aux}  # the ones backward() reads
_KB_BWD_SCALARS = ${bwd_scalars}
_KB_LEARNABLE = ${learnable}  # aux tensors with a gradient (backward() returns them after dq, dk, dv)


def _op_forward(${fwd_params}) -> tuple[${fwd_types}]:
${fwd_body}


def _op_forward_fake(${fwd_names}):
    # output shapes from the inputs' shapes (symbolic under torch.compile), dtypes as forward() allocates them
    return (${fwd_fakes})


${kb_forward}


def _op_infer(${fwd_params}) -> tuple[${infer_types}]:
    # a call no gradient will be asked of: o in the inputs' dtype, no fp32 copy for a backward
    return _kb_forward(q, k, v, sm_scale=sm_scale${fwd_kwargs})


def _op_infer_fake(${fwd_names}):
    return (${infer_fakes})


def _op_backward(${bwd_params}) -> tuple[${bwd_types}]:
${bwd_body}


def _op_backward_fake(${bwd_names}):
    return (${bwd_fakes})


def _op_setup(ctx, inputs, output):
    q, k, v = inputs[:3]
    aux = inputs[3:3 + len(_KB_AUX)]
    ctx.scalars, ctx.sm_scale = inputs[3 + len(_KB_AUX):-1], inputs[-1]
    ctx.save_for_backward(q, k, v, ${saved_o}, output[${lse_index}], *aux)
    ctx.mark_non_differentiable(${non_differentiable})
    ctx.set_materialize_grads(False)  # lse and the fp32 O get no gradient: no zero tensors filled for them


def _op_grads(ctx, dout, *_not_differentiable):
    q, k, v, o, lse, *aux = ctx.saved_tensors
    if dout is None:  # the loss does not read o
        return (None,) * (3 + len(_KB_AUX) + len(_KB_SCALARS) + 1)
    named = dict(zip(_KB_AUX, aux))
    scalars = dict(zip(_KB_SCALARS, ctx.scalars))
    grads = _OP_BWD(q, k, v, o, dout.to(q.dtype).contiguous(), lse, *(named[n] for n in _KB_BWD_AUX),
                    *(scalars[n] for n in _KB_BWD_SCALARS), ctx.sm_scale)
    learned = dict(zip(_KB_LEARNABLE, grads[3:]))
    wanted = ctx.needs_input_grad[3:3 + len(_KB_AUX)]
    aux_grads = (learned.get(n) if w else None for n, w in zip(_KB_AUX, wanted))
    return (*grads[:3], *aux_grads, *(None for _ in _KB_SCALARS), None)


def _register_op():
    """torch.ops.kernel_kb.<OP_NAME>, <OP_NAME>_bwd and <OP_NAME>_infer, defined once per process (a second import
    reuses them)."""
    ops = torch.ops.kernel_kb
    if not hasattr(ops, OP_NAME):
        fwd = torch.library.custom_op(f"kernel_kb::{OP_NAME}", _op_forward, mutates_args=())
        fwd.register_fake(_op_forward_fake)
        bwd = torch.library.custom_op(f"kernel_kb::{OP_NAME}_bwd", _op_backward, mutates_args=())
        bwd.register_fake(_op_backward_fake)
        fwd.register_autograd(_op_grads, setup_context=_op_setup)
        infer = torch.library.custom_op(f"kernel_kb::{OP_NAME}_infer", _op_infer, mutates_args=())
        infer.register_fake(_op_infer_fake)
    return (getattr(ops, OP_NAME).default, getattr(ops, OP_NAME + "_bwd").default,
            getattr(ops, OP_NAME + "_infer").default)


_OP, _OP_BWD, _OP_INFER = _register_op()


def kb_attention(q, k, v, *, sm_scale=None, **aux_and_scalars):
    """Attention of `${fwd}` as the operator torch.ops.kernel_kb.<OP_NAME>: ${differentiable}.
    A call that needs no gradient runs <OP_NAME>_infer instead (eager: its function itself, skipping the dispatcher)."""
    kw = dict(aux_and_scalars)
    missing = [n for n in _KB_AUX + _KB_SCALARS if n not in kw]
    if missing:
        raise ForwardArgumentError(f"kb_attention() needs {missing}")
    aux = tuple(kw.pop(n) for n in _KB_AUX)
    scalars = tuple(float(kw.pop(n)) for n in _KB_SCALARS)
    if kw:
        raise ForwardArgumentError(f"kb_attention() got unexpected arguments: {sorted(kw)}")
    tensors = (q, k, v, *aux)
    if _direct(tensors):
        return _kb_forward(q, k, v, sm_scale=sm_scale, **dict(zip(_KB_AUX, aux)), **dict(zip(_KB_SCALARS, scalars)))[${o_index}]
    op = _OP if torch.is_grad_enabled() and any(t.requires_grad for t in tensors) else _OP_INFER
    return op(q, k, v, *aux, *scalars, None if sm_scale is None else float(sm_scale))[${o_index}]
''')

# what the operator runs for a forward: forward() itself, or first the `.cu` the module dispatches to (kb.lower.cuda_dispatch)
_KB_FORWARD = '''def _kb_forward(q, k, v, *, sm_scale=None, **aux_and_scalars):
    """forward(): this module dispatches to no `.cu`."""
    return forward(q, k, v, sm_scale=sm_scale, **aux_and_scalars)'''
_KB_FORWARD_CUDA = '''def _kb_forward(q, k, v, *, sm_scale=None, **aux_and_scalars):
    """The `.cu` beside this module where CUDA_FORWARD lists this GPU and head dim, else forward()."""
    outs = _cuda_forward(q, k, v, sm_scale, aux_and_scalars)
    return outs if outs is not None else forward(q, k, v, sm_scale=sm_scale, **aux_and_scalars)'''

_FORWARD = Template('''\
    return _kb_forward(q, k, v, sm_scale=sm_scale${kwargs})''')

# the backward reads an fp32 O (Δ = rowsum(dO∘O) exact as an fp32-math spec's own gradient): forward() writes o in the
# inputs' dtype for the user and, in the same store, an fp32 copy, a third, non-differentiable output saved for the
# backward (empty for fp32 inputs, whose o is already fp32)
_FORWARD_EXACT_O = Template('''\
    if q.dtype == torch.float32:
        outs = forward(q, k, v, sm_scale=sm_scale${kwargs})
        return (*outs, outs[${o_index}].new_empty(0))
    return forward(q, k, v, sm_scale=sm_scale${kwargs}, _o32=True)''')

_RAISE = Template('''\
    raise NotImplementedError(f"kernel_kb.{OP_NAME} (program ${fwd}) has no backward: {NO_BACKWARD}")''')

_CALL_BACKWARD = Template('''\
    return backward(q, k, v, o, dout, lse, sm_scale=sm_scale${kwargs})''')
# the `.cu`'s Hopper backward first, where CUDA_BACKWARD lists the GPU and head dim (kb.lower.cuda_dispatch)
_CALL_BACKWARD_CUDA = Template('''\
    grads = _cuda_backward(q, k, v, o, dout, lse, sm_scale, {${named}})
    return grads if grads is not None else backward(q, k, v, o, dout, lse, sm_scale=sm_scale${kwargs})''')


def _dim_sources(params: list[Param]) -> dict[str, str]:
    """Each symbolic dim's spelling from the first input that has it (`q.shape[2]`)."""
    found: dict[str, str] = {}
    for q in params:
        for i, d in enumerate(q.shape):
            if isinstance(d, str):
                found.setdefault(d, f"{q.name}.shape[{i}]")
    return found


def _fake(q: Param, dims: dict[str, str], dtype: str, like: str) -> str:
    """`like.new_empty((..), dtype=..)` of OUT param `q`'s shape, each dim spelled from the inputs."""
    missing = [d for d in q.shape if isinstance(d, str) and d not in dims]
    if missing:
        raise KBError(f"output {q.name}: dims {missing} come from no input, so the operator's fake cannot size it")
    shape = ", ".join(str(d) if isinstance(d, int) else dims[d] for d in q.shape)
    return f"{like}.new_empty(({shape}{',' if len(q.shape) == 1 else ''}), dtype={dtype})"


def _typed(names: list[str], scalars: list[str]) -> str:
    tensors = [f"{n}: torch.Tensor" for n in names]
    return ", ".join(tensors + [f"{n}: float" for n in scalars] + ["sm_scale: float | None"])


def _kwargs(names: list[str]) -> str:
    return "".join(f", {n}={n}" for n in names)


def op_section(fwd: Program, module_text: str, bwd: Program | None = None, no_backward: str = NO_BACKWARD_DEFAULT,
               *, cuda: bool = False, cuda_backward: bool = False) -> str:
    """The operator section appended to `module_text` (a module holding `fwd`'s host `forward` and, with `bwd`, its
    host `backward`; `cuda`: and the CUDA dispatch of kb.lower.cuda_dispatch, which the forward then tries first;
    `cuda_backward`: the backward too)."""
    ins = [q for q in fwd.params if q.role is Role.IN]
    if [q.name for q in ins] != ["q", "k", "v"]:
        raise KBError(f"program {fwd.name}: the operator needs the inputs q, k, v, got {', '.join(q.name for q in ins)}")
    aux = [q.name for q in fwd.params if q.role is Role.AUX]
    scalars = [q.name for q in fwd.params if q.role is Role.SCALAR and q.name != "sm_scale"]
    outs = [q for q in fwd.params if q.role is Role.OUT]
    names = [q.name for q in outs]
    if "o" not in names or "lse" not in names:
        raise KBError(f"program {fwd.name}: the operator needs o and lse among the outputs, got {', '.join(names)}")
    dims = _dim_sources([q for q in fwd.params if q.role in (Role.IN, Role.AUX)])
    fakes = [_fake(q, dims, out_dtype(q, ins[0]), "q") for q in outs]
    bwd_names = ["q", "k", "v", "o", "dout", "lse"]
    if bwd is None:
        bwd_aux, bwd_scalars, learnable, n_grads = list(aux), list(scalars), [], 3
        body = _RAISE.substitute(fwd=fwd.name)
        bwd_fakes = "q.new_empty(q.shape), k.new_empty(k.shape, dtype=q.dtype), v.new_empty(v.shape, dtype=q.dtype)"
    else:
        bwd_aux = [q.name for q in bwd.params if q.role is Role.AUX]
        bwd_scalars = [q.name for q in bwd.params if q.role is Role.SCALAR and q.name != "sm_scale"]
        pairs = aux_gradients(bwd)
        learnable, n_grads = list(pairs.values()), 3 + len(pairs)
        bdims = _dim_sources([q for q in bwd.params if q.role in (Role.IN, Role.AUX)])
        bin0 = next(q for q in bwd.params if q.role is Role.IN)
        named = ", ".join(f"{n!r}: {n}" for n in bwd_aux + bwd_scalars)
        body = (_CALL_BACKWARD_CUDA.substitute(named=named, kwargs=_kwargs(bwd_aux + bwd_scalars)) if cuda_backward
                else _CALL_BACKWARD.substitute(kwargs=_kwargs(bwd_aux + bwd_scalars)))
        # dq, dk, dv as backward() allocates them, each aux gradient in its aux tensor's dtype (backward() casts it)
        bwd_fakes = ", ".join([_fake(bwd.param(g), bdims, out_dtype(bwd.param(g), bin0), "q") for g in ("dq", "dk", "dv")]
                              + [_fake(bwd.param(g), bdims, f"{a}.dtype", "q") for g, a in pairs.items()])
    infer_fakes = list(fakes)
    # o follows the inputs' dtype (not a spec's deliberate fp32 output) and the backward reads it in fp32
    exact_o = bwd is not None and bwd.param("o").dtype is Dtype.F32 and out_dtype(fwd.param("o"), ins[0]) == "q.dtype"
    if exact_o:  # the fp32 O saved for the backward, beside o and lse
        outs_fake = _fake(fwd.param("o"), dims, "torch.float32", "q")
        fakes.append(f"{outs_fake} if q.dtype != torch.float32 else q.new_empty(0, dtype=torch.float32)")
    fwd_body = (_FORWARD_EXACT_O if exact_o else _FORWARD).substitute(kwargs=_kwargs(aux + scalars), o_index=names.index("o"))
    saved_o = (f"output[{names.index('o')}] if output[-1].numel() == 0 else output[-1]" if exact_o
               else f"output[{names.index('o')}]")
    bwd_all = bwd_names + bwd_aux
    no_backward_line = f"{_NO_BACKWARD_LINE}{None if bwd is not None else no_backward!r}  # None: it has a backward"
    return _SECTION.substitute(
        kernel_id=repr("k-" + content_hash(fwd)[:16]), op_name=repr(op_name(fwd, module_text, None if bwd else no_backward)),
        no_backward_line=no_backward_line, aux=repr(tuple(aux)), scalars=repr(tuple(scalars)),
        bwd_aux=repr(tuple(bwd_aux)), bwd_scalars=repr(tuple(bwd_scalars)), learnable=repr(tuple(learnable)),
        fwd_params=_typed(["q", "k", "v", *aux], scalars), fwd_types=", ".join("torch.Tensor" for _ in fakes),
        fwd_body=fwd_body, saved_o=saved_o, fwd_names=", ".join(["q", "k", "v", *aux, *scalars, "sm_scale"]),
        fwd_fakes=", ".join(fakes) + ("," if len(fakes) == 1 else ""),
        bwd_params=_typed(bwd_all, bwd_scalars), bwd_types=", ".join("torch.Tensor" for _ in range(n_grads)),
        bwd_body=body, bwd_names=", ".join([*bwd_all, *bwd_scalars, "sm_scale"]), bwd_fakes=bwd_fakes,
        o_index=names.index("o"), lse_index=names.index("lse"), fwd=fwd.name,
        kb_forward=_KB_FORWARD_CUDA if cuda else _KB_FORWARD, fwd_kwargs=_kwargs(aux + scalars),
        infer_types=", ".join("torch.Tensor" for _ in infer_fakes),
        infer_fakes=", ".join(infer_fakes) + ("," if len(infer_fakes) == 1 else ""),
        non_differentiable=f"output[{names.index('lse')}]" + (", output[-1]" if exact_o else ""),
        differentiable=(f"differentiable in q, k, v{' and ' + ', '.join(learnable) if learnable else ''}" if bwd is not None
                        else "its backward raises NO_BACKWARD"))


def with_backward_reason(source: str, reason: str) -> str:
    """A forward-only module's source with NO_BACKWARD saying `reason` (why `kb generate` built no backward), and the
    OP_NAME that goes with it."""
    text, marker, section = source.partition(_SECTION_MARKER)
    lines = section.split("\n")
    at = [i for i, line in enumerate(lines) if line.startswith(_NO_BACKWARD_LINE)]
    name = [i for i, line in enumerate(lines) if line.startswith(_OP_NAME_LINE)]
    if not marker or len(at) != 1 or len(name) != 1:
        raise KBError("not a generated forward module with one operator section")
    if lines[at[0]].startswith(f"{_NO_BACKWARD_LINE}None"):
        raise KBError("this module has a backward; it has no NO_BACKWARD reason to set")
    lines[at[0]] = f"{_NO_BACKWARD_LINE}{reason!r}  # None: it has a backward"
    old_name, comment = lines[name[0]][len(_OP_NAME_LINE):].split("  #", 1)
    kernel_hex = old_name.strip("'\"").split("_")[1]
    lines[name[0]] = f"{_OP_NAME_LINE}{_name(kernel_hex, text, reason)!r}  #{comment}"
    return text + marker + "\n".join(lines)
