"""Emit a generated kernel as files: KernelBench candidate (ModelNew), Triton module, CUDA, IR, report.

The candidate file is self-contained: the generated Triton module's source followed by a
`ModelNew` with the spec's constructor and forward signature. It never names the spec's
`Model` nor imports the spec (the verifier treats that as a hack).

State: `ModelNew` holds every entry of the spec Model's state_dict under the same key
(parameters as nn.Parameter, buffers as buffers; initial values saved next to it in
`<stem>.aux.pt`), so `ModelNew.load_state_dict(Model.state_dict())` works. The kernel reads
the ones it uses at every call (a learnable temperature or bias table takes its current
value). Loading adopts the loaded shapes (a table sized by other constructor
arguments than generation's). Buffers compiled into the kernel as the index expression their value equals (a tril
mask) are checked when a state_dict is loaded: a different value is refused, never ignored.
Other constant aux tensors (plain tensor attributes, module-level tensors of FlexAttention
specs) are non-persistent buffers; aux tensors that are forward inputs are passed through.

Dtypes: the kernel takes the inputs in the dtype the user passes and writes `spec.output_dtype`
(a spec that upcasts bf16 inputs and returns fp32 gets an fp32-accurate kernel on bf16 tiles).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch

from generate.outputs import write_error
from generate.serving_bind import ServingBinding
from generate.spec import DTYPES, Spec
from kb.errors import KBError

__all__ = ["CandidateFiles", "forward_signature", "write_candidate"]


@dataclass(frozen=True)
class CandidateFiles:
    candidate: Path  # KernelBench ModelNew (self-contained)
    triton: Path  # the Triton module alone (importable; `forward(q, k, v, ...)`)
    aux: Path | None


def forward_signature(spec: Spec) -> tuple[list[str], tuple[str, str, str]]:
    """(forward parameter names, names of q, k, v) of the spec's call."""
    if spec.forward_names:
        return list(spec.forward_names), spec.qkv_names
    return ["q", "k", "v"], ("q", "k", "v")


def _constants(spec: Spec, forward_names: list[str]) -> dict[str, torch.Tensor]:
    """Aux tensors that are neither forward inputs nor state: constants of the spec."""
    state = {e.aux for e in spec.state if e.aux}
    return {n: t for n, t in spec.aux.items() if n not in forward_names and n not in state}


def _torch_dtype(name: str) -> str:
    return "_torch." + str(DTYPES[name]).removeprefix("torch.")


def _aux_arg(name: str, spec: Spec, forward_names: list[str]) -> str:
    """The expression ModelNew passes for the kernel's aux tensor `name` (0-dim tensors as shape [1])."""
    entry = next((e for e in spec.state if e.aux == name), None)
    if name in spec.derived_aux:
        src, right = spec.derived_aux[name]
        qn, kn, _ = spec.qkv_names
        n = f"max({qn}.shape[2], {kn}.shape[2])"
        if spec.layout is not None and spec.layout.kind == "varlen":  # ids of packed tokens: q's, or k's offsets
            n = f"{kn}.shape[0]" if src == spec.layout.table_k and src != spec.layout.table else f"{qn}.shape[0]"
        return (f"_kb_searchsorted(self, {name!r}, {src}, {n}, right={right}, "
                f"out_int32={spec.aux[name].dtype == torch.int32})")
    if name in forward_names:
        return f"{name}.reshape(1) if {name}.dim() == 0 else {name}" if spec.aux[name].shape == (1,) else name
    if entry is not None:
        get = "get_parameter" if entry.parameter else "get_buffer"
        flat = ".reshape(1)" if spec.state_values[entry.key].dim() == 0 else ""
        return f"self.{get}({entry.key!r}){flat}"
    return f"self.{name}"


_HELPERS = '''
def _kb_register(module, key, value, parameter):
    """Register `value` at the dotted state_dict `key` (submodules created as needed)."""
    *path, leaf = key.split(".")
    for part in path:
        if part not in module._modules:
            module.add_module(part, _torch.nn.Module())
        module = module._modules[part]
    if parameter:
        module.register_parameter(leaf, _torch.nn.Parameter(value))
    else:
        module.register_buffer(leaf, value)


def _kb_searchsorted(module, name, offsets, n, right, out_int32):
    """Ids of positions 0..n-1 from sorted offsets, computed once per offsets tensor (the same object, unmodified
    since: torch's version counter) and length, so the kernel's block table is found again without a compare.
    Under torch.compile or CUDA-graph capture they are computed every call (a graph replays with new contents)."""
    if _torch.compiler.is_compiling() or (offsets.is_cuda and _torch.cuda.is_current_stream_capturing()):
        return _torch.searchsorted(offsets, _torch.arange(n, device=offsets.device, dtype=offsets.dtype), right=right,
                                   out_int32=out_int32)
    cache = module.__dict__.setdefault("_kb_derived", {})
    hit = cache.get(name)
    if hit is not None and hit[0]() is offsets and hit[1] == (offsets._version, n):
        return hit[2]
    ids = _torch.searchsorted(offsets, _torch.arange(n, device=offsets.device, dtype=offsets.dtype), right=right,
                              out_int32=out_int32)
    cache[name] = (_weakref.ref(offsets), (offsets._version, n), ids)
    return ids


def _kb_adopt_shapes(module, state_dict, prefix, *_):
    """load_state_dict pre-hook: a parameter or buffer the kernel takes as an input adopts the loaded tensor's shape
    (ModelNew starts from the generation-time state, so a table sized by other constructor arguments, say more heads,
    arrives with another shape); the same Parameter object stays registered, so optimizers keep it."""
    for key, new in state_dict.items():
        if not key.startswith(prefix) or key[len(prefix):] in _KB_BAKED or not isinstance(new, _torch.Tensor):
            continue
        *path, leaf = key[len(prefix):].split(".")
        owner = module
        for part in path:
            owner = owner._modules.get(part) if owner is not None else None
        old = None if owner is None else owner._parameters.get(leaf, owner._buffers.get(leaf))
        if old is not None and old.shape != new.shape:
            with _torch.no_grad():
                old.data = _torch.empty(new.shape, dtype=old.dtype, device=old.device)


def _kb_check_baked(module, incompatible_keys):
    """Buffers compiled into the kernel as the index expression their value equals must keep that value."""
    saved = _torch.load(_KB_STATE)["state"]
    changed = [k for k in _KB_BAKED if not _torch.equal(module.get_buffer(k).detach().cpu(), saved[k])]
    if changed:
        raise RuntimeError(f"buffer(s) {changed} are compiled into this kernel as the index expressions their "
                           "generation-time values equal; a state_dict with other values needs a regenerated kernel")
'''


def _serving_args(binding: ServingBinding, spec: Spec) -> tuple[str, str]:
    """(q, k, v arguments, the page size keyword) of a serving kernel's call on the spec's own inputs: a paged cache
    is passed as its token rows (`flatten(0, 1)`, a view) where the program reads rows (generate.serving_bind)."""
    assert spec.layout is not None
    given = dict(binding.inputs)
    rows = binding.token_rows and spec.layout.kind in ("paged", "chunked")
    qkv = ", ".join(f"{given[t]}.flatten(0, 1)" if rows and t != "q" else given[t] for t in ("q", "k", "v"))
    more = ""
    if binding.max_rows is not None:  # varlen, chunked: q's token count bounds every sequence's length
        more += f", {binding.max_rows}={given['q']}.shape[0]"
    if binding.page_size is not None:
        more += f", {binding.page_size}={given['k'] + '.shape[1]' if spec.layout.kind != 'pool' else '1'}"
    return qkv, more


def write_candidate(spec: Spec, triton_source: str, program_aux: list[str], out_dir: Path, stem: str,
                    serving: ServingBinding | None = None) -> CandidateFiles:
    """Write the candidate and the plain Triton module; returns their paths.

    ModelNew calls the module's `kb_attention`, the registered operator (kb.lower.triton_op): differentiable when the
    module holds a backward, raising NO_BACKWARD on backward when it does not."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names, (qn, kn, vn) = forward_signature(spec)
    passed = dict(serving.inputs) if serving is not None else {}  # serving: table and lengths are forward inputs
    missing = [a for a in program_aux if a not in spec.aux and a not in passed]
    if missing:
        raise KBError(f"program loads aux tensors {missing} that the spec does not provide")
    saved = {"state": {k: t.detach().cpu().contiguous() for k, t in spec.state_values.items()},
             "constants": {n: t.detach().cpu().contiguous() for n, t in _constants(spec, names).items()}}
    aux_path = None
    if saved["state"] or saved["constants"]:
        aux_path = out_dir / f"{stem}.aux.pt"
        _write(aux_path, _saved_bytes(saved))
    triton_path = out_dir / f"{stem}_triton.py"
    _write(triton_path, triton_source.encode())
    aux_kwargs = "".join(f", {a}={passed[a] if a in passed else _aux_arg(a, spec, names)}" for a in program_aux)
    scale = "None" if spec.scale is None else repr(float(spec.scale))  # None: 1/sqrt(D) of the inputs at run time
    qkv = ", ".join((qn, kn, vn))
    if serving is not None:
        qkv, more = _serving_args(serving, spec)
        aux_kwargs += more
    out = _torch_dtype(spec.output_dtype)
    params = tuple(e.key for e in spec.state if e.parameter)
    baked = tuple(e.key for e in spec.state if e.baked)
    lines = [
        triton_source.rstrip(),
        "",
        "",
        "# ---- KernelBench candidate generated by kernel-kb ----",
        "import weakref as _weakref",
        "import torch as _torch",
        "from pathlib import Path as _Path",
        "",
        f"_KB_STATE = _Path(__file__).with_name({aux_path.name!r})" if aux_path else "_KB_STATE = None",
        f"_KB_PARAMETERS = {params!r}  # state_dict keys that are nn.Parameters of the spec's Model",
        f"_KB_BAKED = {baked!r}  # buffers held by the kernel as the index expression their value equals",
        _HELPERS,
        "",
        "class ModelNew(_torch.nn.Module):",
        f"    def __init__(self{_init_signature(spec)}):",
        "        super().__init__()",
        "        # the spec Model's state under its own keys (initial values saved at generation time; a",
        "        # verifier or user loads the real ones with load_state_dict), and its constant tensors",
        '        _saved = _torch.load(_KB_STATE) if _KB_STATE is not None else {"state": {}, "constants": {}}',
        '        for _key, _t in _saved["state"].items():',
        "            _kb_register(self, _key, _t, _key in _KB_PARAMETERS)",
        '        for _name, _t in _saved["constants"].items():',
        "            self.register_buffer(_name, _t, persistent=False)",
        "        self.register_load_state_dict_pre_hook(_kb_adopt_shapes)",
        "        if _KB_BAKED:",
        "            self.register_load_state_dict_post_hook(_kb_check_baked)",
        *[f"        if {name} != {value!r}:\n"
          f"            raise ValueError(f'this kernel was generated for {name}={value!r}, which it holds as a constant; "
          f"not {{{name}!r}}: run kb generate with get_init_inputs() giving that value')"
          for _, name, value in spec.init_fixed],
        "",
        f"    def forward(self, {', '.join(names)}):",
        *([f"        if {qn}.shape[1] != {spec.heads_fixed}:",
           f"            raise ValueError(f'this kernel was generated for {spec.heads_fixed} query heads (the spec computes "
           f"its score/mask constants from the head count), not {{{qn}.shape[1]}}: run kb generate for that head count')"]
          if spec.heads_fixed else []),
        *([f"        if ({qn}.shape[2], {kn}.shape[2]) != {spec.lengths_fixed}:",
           f"            raise ValueError(f'this kernel was generated for sequence lengths (M, N) = {spec.lengths_fixed} (the "
           f"spec runs at no other lengths, so its constants may come from them), not {{({qn}.shape[2], {kn}.shape[2])}}"
           f": run kb generate with inputs of those lengths')"] if spec.lengths_fixed else []),
        f"        _o = kb_attention({qkv}, sm_scale={scale}{aux_kwargs})  # the operator torch.ops.kernel_kb.<OP_NAME>",
        # the output follows the inputs' dtype (as the spec's torch ops would), unless the spec returns another
        *([f"        return _o if _o.dtype == {out} else _o.to({out})"] if spec.output_dtype != spec.shapes.dtype
          else ["        return _o"]),
        "",
    ]
    cand = out_dir / f"{stem}.py"
    _write(cand, "\n".join(lines).encode())
    return CandidateFiles(cand, triton_path, aux_path)


def _saved_bytes(saved: dict) -> bytes:
    """torch.save into memory: its own writer reports a full disk as a RuntimeError without the path."""
    buf = io.BytesIO()
    torch.save(saved, buf)
    return buf.getvalue()


def _write(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as err:
        raise write_error(path, err) from None


def _init_signature(spec: Spec) -> str:
    """`, a, b=1` for the spec Model's constructor (defaults kept), or '' for none."""
    return "".join(f", {p}" for p in spec.init_params)
