"""The fixed parts of a generated Triton module around its IR kernels, as templates with holes.

As Inductor keeps FlexAttention's algorithm in one template and injects score_mod/mask_mod into it, the code a
module runs around its kernels is written out here once, as it appears in the generated file, and only the
program-specific pieces are filled in (`string.Template` holes, `${name}`):
- `design_lines`: the module's constants (PROGRAM, the design table DESIGNS, PROGRAM_DESIGN); a backward's
  (`backward_design_lines`) are BWD_PROGRAM, BWD_DESIGNS, BWD_PROGRAM_DESIGN and BWD_OUTPUTS;
- `class_kernel`: the block-class kernel that fills the host table, with the program's mask_mod injected;
- `host_function`: the host `forward` (or a backward's `backward`): argument checks, then `launch(design)`,
  which allocates the outputs, builds or reuses the block table and launches every kernel.
A hole that stands for zero or more whole lines sits at the start of a line and its value ends with a newline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import builtins
from string import Template
from typing import Callable, Iterable

from kb.errors import KBError
from kb.ir.design import Design, DesignTable
from kb.ir.expr import free_vars, loaded_tensors
from kb.ir.nodes import DOT_MIN_K, Kernel, Param, Program, Role, VALUE_DIM
from kb.lower.block_mask import EMPTY, FULL, PARTIAL, BlockMaskPlan
from kb.lower.expr_context import DTYPE_KIND, AuxRef, ExprContext, ExprTarget, Kind, Sym, visible_names
from kb.lower.pack_gqa import PACK_ROWS, PackPlan
from kb.lower.split_direct import split_kernels
from kb.lower.serving import is_serving, split_kv_blocks
from kb.lower.triton_code import TORCH_DTYPE, strip_parens, wrap
from kb.lower.triton_expr import lower_expr
from kb.lower.triton_tiles import Signature

__all__ = ["HostEntry", "HOST_NAMES", "host_name_clash", "check_host_names", "out_dtype", "kernel_fn_name", "packed_fn_name", "split_kernels", "design_lines", "backward_design_lines",
           "class_kernel", "host_function"]


# Names the generated host code binds or reads (its functions' locals, the module's globals, Python's builtins): an aux
# tensor or scalar is bound under its own name in `forward`/`backward` and the operator's functions, so it must not
# take one of these (spec tracing renames a captured `self.table` to `table_aux`; other programs are refused)
HOST_NAMES = frozenset(dir(builtins)) | {
    "math", "os", "torch", "triton", "tl", "weakref", "logging", "forward", "backward", "kb_attention",
    "block_class_table", "ForwardArgumentError", "PROGRAM", "DESIGNS", "PROGRAM_DESIGN", "KERNEL_ID", "OP_NAME",
    "NO_BACKWARD", "kw", "dims", "launch", "design", "key", "plan", "rec", "table", "bc", "kvl", "qvl", "block_class",
    "only_table", "table_only", "aux_and_scalars", "classes", "aux", "scalars", "missing", "named", "grads", "learned",
    "wanted", "aux_grads", "ctx", "inputs", "output", "ops", "fwd", "bwd", "tma", "num_warps", "num_stages", "PACK",
    "USE_TMA", "WARP_SPEC", "HEAD_PAD", "HEAD_PAD_V", "EVEN_D", "EVEN_DV", "NUM_SPLITS", "BLOCK_M", "BLOCK_N"}


def host_name_clash(name: str) -> bool:
    """Whether a param called `name` would shadow or be shadowed by a name of the generated host code."""
    return name in HOST_NAMES or name.startswith(("_", "POS_", "PAD_", "BWD_"))


def check_host_names(p: Program) -> None:
    """KBError (one line) when an aux tensor or scalar of `p` is named like the generated host code's own names."""
    clash = [q.name for q in p.params if q.role in (Role.AUX, Role.SCALAR) and q.name != "sm_scale" and host_name_clash(q.name)]
    if clash:
        raise KBError(f"program {p.name}: aux/scalar param(s) {clash} would clash with names of the generated Triton "
                      "module's host code; rename them")


def kernel_fn_name(k: Kernel) -> str:
    return f"_{k.name}_kernel"


def packed_fn_name(k: Kernel) -> str:
    return f"_{k.name}_packed_kernel"


def _lines(text: str) -> list[str]:
    return text.split("\n")


def _block(lines: Iterable[str]) -> str:
    """Whole lines for a hole at the start of a line."""
    return "".join(f"{x}\n" for x in lines)


def _tuple_body(names: list[str]) -> str:
    """The inside of a tuple display of `names` (a trailing comma for one; nothing for none)."""
    return ", ".join(names) + ("," if len(names) == 1 else "")


# ------------------------------------------------------------------ module constants


_DESIGNS = Template('''\
PROGRAM = ${program}
# Designs per GPU arch and head-dim bucket, best first, chosen by kernel-kb from what its KB knew
# (measured records, expert tunables): (BLOCK_M, BLOCK_N, NUM_SPLITS, num_warps, num_stages, tma, pack_gqa);
# NUM_SPLITS 0 = chosen at launch from the grid and the SM count
# GQA packing: ${packing}
DESIGNS = ${designs}
# the program's own schedule: run by the interpreter (and verified there), and timed on a GPU the table misses
PROGRAM_DESIGN = ${own}
# on a listed GPU: time the designs that fit once per shape bucket and run the fastest (else the first that fits);
# KB_DESIGN_TIMING=0 turns timing off for a process
TIME_DESIGNS = ${timed}

''')


_BWD_DESIGNS = Template('''\
BWD_PROGRAM = ${program}
# Backward designs per GPU arch and head-dim bucket, best first: (BLOCK_M, BLOCK_N, NUM_SPLITS, num_warps,
# num_stages, tma, pack_gqa); backward programs do not pack GQA heads (their KV-outer loop walks the group)
BWD_DESIGNS = ${designs}
# the backward program's own schedule: run by the interpreter (and verified there)
BWD_PROGRAM_DESIGN = ${own}
BWD_TIME_DESIGNS = ${timed}  # as TIME_DESIGNS, for the backward's designs
BWD_OUTPUTS = ${outputs}  # what backward() returns, in order

''')


def _design_table(designs: DesignTable | None, spell: Callable[[Design], tuple]) -> dict[str, dict[int, list[tuple]]]:
    """{arch: {head-dim bucket: design tuples, best first, deduplicated}}, sorted, each design spelled by `spell`."""
    return {arch: {bucket: list(dict.fromkeys(spell(d) for d in ds)) for bucket, ds in sorted(by.items())}
            for arch, by in sorted((designs or {}).items())}


def design_lines(p: Program, designs: DesignTable | None, packs: dict | str, timed: bool) -> list[str]:
    """Module constants: the design table (per arch and head-dim bucket, best first), the program's own schedule and
    whether a listed GPU times the listed designs (`timed`: LowerOptions.time_designs).

    A program that cannot pack lists its designs unpacked (deduplicated), so the table says what runs; a split-KV
    program that can pack verifies its packed form (its own schedule packs)."""
    packable = isinstance(packs, dict)
    table = _design_table(designs, Design.as_tuple if packable else lambda d: dataclasses.replace(d, pack_gqa=False).as_tuple())
    own = Design.of_schedule(p.schedule, tma=True, pack_gqa=packable and bool(split_kernels(p))).as_tuple()
    packing = "available (designs with pack_gqa run the packed kernels)" if packable else f"not used, {packs}"
    return _lines(_DESIGNS.substitute(program=repr(p.name), packing=packing, designs=repr(table), own=repr(own),
                                      timed=repr(timed)))


def backward_design_lines(p: Program, designs: DesignTable | None, outputs: tuple[str, ...],
                          timed: bool) -> list[str]:
    """A backward module's constants (BWD_*, beside a forward's in one module): its design table, its own schedule
    (no tensor descriptors, no packing), whether a listed GPU times the designs and the names `backward` returns
    (`outputs`)."""
    own = Design.of_schedule(p.schedule, tma=False, pack_gqa=False).as_tuple()
    return _lines(_BWD_DESIGNS.substitute(program=repr(p.name), designs=repr(_design_table(designs, Design.as_tuple)),
                                          own=repr(own), outputs=repr(outputs), timed=repr(timed)))


# ------------------------------------------------------------------ block-class kernel


_CLASS_KERNEL = Template('''\
@triton.jit
def ${name}(
${args}):
    # one program per tile of the table [nb, nh, nm, nn], flattened; the mask is evaluated in registers
    pid = tl.program_id(0)
    j = pid % bc_nn
    pid = pid // bc_nn
    m = pid % bc_nm
    pid = pid // bc_nm
    h = pid % bc_nh
    b = pid // bc_nh
    offs_q = m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_kv = j * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = (offs_q[:, None] < ${m_dim}) & (offs_kv[None, :] < ${n_dim})
    attend = in_range & ${mask}
    n_in = tl.sum(tl.sum(in_range.to(tl.int32), 1), 0)
    n_att = tl.sum(tl.sum(attend.to(tl.int32), 1), 0)
    cls = tl.where(n_att == 0, ${empty}, tl.where((n_att == n_in) & ((j + 1) * BLOCK_N <= ${n_dim}), ${full}, ${partial}))
    tl.store(bc_ptr + b * stride_bc_0 + h * stride_bc_1 + m * stride_bc_2 + j * stride_bc_3, cls.to(tl.int8))
''')


def class_kernel(p: Program, sig: Signature, plan: BlockMaskPlan, name: str = "_block_class_kernel") -> list[str]:
    """`_block_class_kernel`: one program per (b, h, m block, n block) of the table writes that tile's class of
    mask_mod (0 empty, 1 partial, 2 full; a tile past N is never full), evaluated in registers on the GPU."""
    assert p.mask_mod is not None
    aux = [q for q in p.params if q.role is Role.AUX]
    q_shape, m_dim, n_dim = p.param("q").shape, str(p.param("q").shape[2]), str(p.param("k").shape[2])
    names = visible_names(sig.dims, sig.scalars)
    for n, dim, used in (("b", q_shape[0], plan.per_b), ("h", q_shape[1], plan.per_h)):
        names[n] = Sym(n, Kind.INT, True, str(dim) if used and isinstance(dim, str) else None)
    names["q_idx"] = Sym("offs_q[:, None]", Kind.INT, True)
    names["kv_idx"] = Sym("offs_kv[None, :]", Kind.INT, True)
    refs = {q.name: AuxRef(f"{q.name}_ptr", tuple(f"stride_{q.name}_{i}" for i in range(len(q.shape))),
                           tuple(str(d) for d in q.shape), DTYPE_KIND[q.dtype]) for q in aux}
    mask = strip_parens(lower_expr(p.mask_mod.body, ExprContext(ExprTarget.DEVICE, names, refs)))
    args = [f"{q.name}_ptr" for q in aux] + [f"stride_{q.name}_{i}" for q in aux for i in range(len(q.shape))] \
        + list(sig.dims) + [q.name for q in sig.scalars] \
        + ["bc_ptr", "stride_bc_0", "stride_bc_1", "stride_bc_2", "stride_bc_3", "bc_nh", "bc_nm", "bc_nn",
           "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"]
    return _lines(_CLASS_KERNEL.substitute(name=name, args=_block(f"    {a}," for a in args), m_dim=m_dim, n_dim=n_dim,
                                           mask=wrap(mask), empty=EMPTY, full=FULL, partial=PARTIAL))


# ------------------------------------------------------------------ host function


@dataclass(frozen=True)
class HostEntry:
    """What a module's host function is: the forward's `forward` by default; kb.lower.triton_bwd makes `backward`
    (its own design chooser and block-class kernel, so it can sit in one module beside a forward)."""

    name: str = "forward"
    chooser: str = "_choose_design"  # picks the design per GPU and shape
    class_kernel: str = "_block_class_kernel"
    table_tag: str = ""  # leading entries of the block-table cache key (code), e.g. '"bwd", '
    zeroed: tuple[str, ...] = ()  # tensors allocated zero-filled (accumulated into)
    returns: tuple[str, ...] = ()  # the returned expressions; () = the OUT params
    table_helper: bool = True  # emit block_class_table()
    plans: bool = True  # replay launch plans (_Plan) for repeated call signatures; needs plain returns and no table
    exact_o: bool = True  # `_o32=`: o also written in fp32 (a backward's Δ; kb.lower.triton_op), where o follows the inputs
    swap_kernels: tuple[str, ...] = ()  # launched with BLOCK_M and BLOCK_N exchanged by a dq_swap design (triton_bwd)


_HOST_FUNCTION = Template('''\
def ${fn}(${params}, _design=None,${o32} **aux_and_scalars):
    """Run `${program}`. Returns (${returned}). Aux tensors: ${aux_names}; scalars: ${scalar_names}.
    The design (tiles, warps, stages) is chosen per GPU and shape from DESIGNS; `_design=` forces one.${o_doc}${plan_doc}"""
${fast}    kw = dict(aux_and_scalars)
${take_aux}    dims = {}
${bind}${take_scalars}${take_table}    if kw:
        raise ForwardArgumentError(f"${fn}() got unexpected arguments: {sorted(kw)}")

    def launch(design, table_only=False, rec=None):
${launch}

    design = tuple(_design) if _design is not None else ${chooser}(${first}, ${head_dim}, (${first}.device, ${first}.dtype, ${dims_key}), launch)
    return ${run}${table_helper}''')

# a forward without a block-class table: a call like an earlier one replays that call's launches (_Plan, _kb_planned)
_FAST_PATH = Template('''\
    key = (${key})
    plan = _PLANS.get(key)
    if plan is not None:
        return plan.replay((${inputs}))
''')

_PLAN_DOC = '''
    A call with the same shapes, strides, dtypes, alignment and scalars as an earlier one replays its launches.'''

_TAKE_AUX = Template('''\
    if "${aux}" not in kw:
        raise ForwardArgumentError("${fn}() needs the aux tensor ${aux}=${shape}")
    ${aux} = kw.pop("${aux}")
''')

_TAKE_SCALAR = Template('''\
    if "${scalar}" not in kw:
        raise ForwardArgumentError("${fn}() needs the scalar ${scalar}=...")
    ${scalar} = ${conv}(kw.pop("${scalar}"))
''')

_SCALAR_CONV = {Kind.FLOAT: "float", Kind.INT: "int", Kind.BOOL: "bool"}  # an int scalar (max_seq_len) sizes grids

_SM_SCALE = Template('''\
    sm_scale = 1.0 / math.sqrt(${first}.shape[-1]) if sm_scale is None else float(sm_scale)
''')

# like FlexAttention's block mask: built once by the caller and passed back, or built here
_TAKE_TABLE = '''\
    block_class, only_table = kw.pop("block_class", None), kw.pop("_only_block_class", False)
'''

_TABLE_HELPER = '''


def block_class_table(*args, **kw):
    """(block classes, block lists) forward(*args, **kw) builds; pass it back as block_class= to reuse it."""
    return forward(*args, _only_block_class=True, **kw)'''


def host_function(p: Program, sig: Signature, plan: BlockMaskPlan, packs: dict | str,
                  entry: HostEntry = HostEntry()) -> list[str]:
    """The host function (`entry.name`) of `p`'s module: check and bind the arguments, choose the design, launch."""
    ins = [q for q in p.params if q.role is Role.IN]
    aux = [q for q in p.params if q.role is Role.AUX]
    scalars = [q for q in p.params if q.role is Role.SCALAR]
    names = visible_names(sig.dims, scalars)
    hctx = ExprContext(ExprTarget.HOST, names)
    first = ins[0].name
    take_scalars = "".join(_SM_SCALE.substitute(first=first) if q.name == "sm_scale"
                           else _TAKE_SCALAR.substitute(scalar=q.name, fn=entry.name, conv=_SCALAR_CONV[DTYPE_KIND[q.dtype]])
                           for q in scalars)
    planned = entry.plans and not sig.table
    inputs = _tuple_body([q.name for q in ins] + [f'aux_and_scalars["{q.name}"]' for q in aux])
    key = ", ".join([f"_tkey({q.name})" for q in ins] + [f'_tkey(aux_and_scalars.get("{q.name}"))' for q in aux]
                    + [f"_skey({q.name})" if q.name == "sm_scale" else f'_skey(aux_and_scalars.get("{q.name}"))'
                       for q in scalars] + ["_design and tuple(_design)", "len(aux_and_scalars)"]
                   + (["_o32"] if sig.o32 else []))
    recorded = _tuple_body([q.name for q in (*ins, *aux)])
    return _lines(_HOST_FUNCTION.substitute(
        fn=entry.name, program=p.name, o32=" _o32=False," if sig.o32 else "",
        o_doc=("\n    `_o32=True` also writes o in fp32 and returns that copy last (the operator's O for the backward)."
               if sig.o32 else ""),
        params=", ".join(q.name for q in ins) + ", *" + (", sm_scale=None" if any(q.name == "sm_scale" for q in scalars) else ""),
        returned=", ".join(entry.returns or tuple(q.name for q in p.params if q.role is Role.OUT)),
        aux_names=", ".join(q.name for q in aux) or "none", scalar_names=", ".join(q.name for q in scalars) or "none",
        take_aux="".join(_TAKE_AUX.substitute(aux=q.name, fn=entry.name, shape=list(q.shape)) for q in aux),
        bind=_block([*(f'    _bind(dims, "{q.name}", {q.name}, {tuple(q.shape)!r})' for q in (*ins, *aux)),
                     *(f'    {d} = dims["{d}"]' for d in sig.dims)]),
        take_scalars=take_scalars, take_table=_TAKE_TABLE if sig.table else "",
        launch=_launch_body(p, sig, plan, hctx, packs, entry),
        chooser=entry.chooser, first=first, head_dim="D" if "D" in sig.dims else f"{first}.shape[-1]",
        dims_key=_tuple_body(list(sig.dims)),
        run=(f"_kb_planned(key, ({recorded}), lambda rec: launch(design, rec=rec))" if planned
             else f"launch(design{', table_only=only_table' if sig.table else ''})"),
        fast=_FAST_PATH.substitute(key=key, inputs=inputs) if planned else "", plan_doc=_PLAN_DOC if planned else "",
        table_helper=_TABLE_HELPER if sig.table and entry.table_helper else ""))


# ------------------------------------------------------------------ launch(design)


_LAUNCH = Template('''\
        BLOCK_M, BLOCK_N, NUM_SPLITS, num_warps, num_stages, tma, PACK = _design7(design)
${pack}        NUM_SPLITS = ${num_splits}
        HEAD_PAD = ${head_pad}
${constexprs}${table}${allocate}${tma}${launches}        return ${returned}''')

_PACK = Template('''\
        # GQA packing: the ${hq} // ${hkv} query heads of a KV head share a tile (K/V read once per KV head)
        PACK = PACK and ${hq} > ${hkv} and ${hq} % ${hkv} == 0
        _PK_ROWS = (${hq} // ${hkv}) * ${m}
''')

_HEAD_PAD_CHECK = '''\
        if HEAD_PAD < D:
            raise ForwardArgumentError(f"schedule head_pad={HEAD_PAD} is smaller than the head dim D={D}")
'''

_TABLE = Template('''\
        # block classes of mask_mod (not decidable in closed form): one GPU program per tile
        classes = lambda bc: ${class_kernel}[(bc.numel(),)](${args}, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        # rebuilt only when the mask's inputs change (compared by content), as FlexAttention's block mask is built once
        table = block_class if block_class is not None else _cached_table((${key}), (${inputs}), lambda: _hblock_table(_hblock_classes(classes, ${nb}, ${nh}, ${m}, ${n}, BLOCK_M, BLOCK_N, ${device})${by_kv}))
        if table_only:
            return table
        ${unpack} = table
''')

_TMA = Template('''\
        # Hopper: tile loads/stores through tensor descriptors (TMA) where the GPU and layouts allow
        USE_TMA = tma and _use_tma((${tensors}), (${sides}))
''')

_KERNEL_LAUNCH = Template('''\
${indent}_kb_launch(rec, ${fn}, (${grid},), (
${indent}    ${args},
${indent}), num_warps, num_stages, ${constexprs})
''')


def _grid_code(k: Kernel, hctx: ExprContext, pack: PackPlan | None, split: bool = True) -> str:
    """The host's launch-grid size of kernel `k` (packed: over KV heads and packed row blocks); without the
    split axes when `split` is False."""
    axes = [a for a in k.grid if split or "NUM_SPLITS" not in free_vars(a.extent)]
    return " * ".join(wrap(lower_expr(pack.extent(a.name, a.extent) if pack else a.extent, hctx)) for a in axes) or "1"


def out_dtype(q: Param, first_in: Param) -> str:
    """The attention output (a tile tensor of q's rank, typed like q in the IR) follows the inputs' dtype at run
    time (bf16 in, bf16 out); any other declared dtype (the LSE's f32, a spec's deliberate fp32 output) is kept."""
    if q.dtype == first_in.dtype and len(q.shape) == len(first_in.shape):
        return f"{first_in.name}.dtype"
    return TORCH_DTYPE[q.dtype]


def _launch_body(p: Program, sig: Signature, plan: BlockMaskPlan, hctx: ExprContext, packs: dict | str,
                 entry: HostEntry) -> str:
    """The body of the host's `launch(design)`: allocate outputs, build the block table, launch every kernel."""
    ins = [q for q in p.params if q.role is Role.IN]
    device = ins[0].name + ".device"
    pack = ""
    if isinstance(packs, dict):
        pk = next(iter(packs.values()))
        hctx = ExprContext(hctx.target, {**hctx.names, PACK_ROWS: Sym("_PK_ROWS", Kind.INT, True)}, hctx.aux)
        pack = _PACK.substitute(hq=pk.hq, hkv=pk.hkv, m=pk.m)
    return _LAUNCH.substitute(
        pack=pack, num_splits=_num_splits(p, hctx, packs, device),
        head_pad=str(p.schedule.fixed_head_pad) if p.schedule.fixed_head_pad else f"max({DOT_MIN_K}, triton.next_power_of_2(D))",
        constexprs=_constexpr_values(sig), table=_table_build(p, sig, plan, entry, device) if sig.table else "",
        allocate=_block(_allocations(p, sig, entry, device)), tma=_tma_choice(p, sig),
        launches=_launches(p, sig, hctx, packs, device, entry.swap_kernels),
        returned=", ".join((*(entry.returns or tuple(q.name for q in p.params if q.role is Role.OUT)),
                            *(["*((o32,) if _o32 else ())"] if sig.o32 else []))))


def _num_splits(p: Program, hctx: ExprContext, packs: dict | str, device: str) -> str:
    """NUM_SPLITS at launch: a split-KV program's 0 is chosen from the grid and the SM count."""
    split = split_kernels(p)
    if not split:
        return "max(1, NUM_SPLITS)"
    base = _grid_code(split[0], hctx, None, split=False)
    if is_serving(p):  # no N: the splits cover a window's blocks or what the page table can hold (kb.lower.serving)
        blocks = split_kv_blocks(p)
        return f"NUM_SPLITS or _auto_splits({base}, {blocks}, {device})" if blocks else "max(1, NUM_SPLITS)"
    if isinstance(packs, dict):
        base = f"({_grid_code(split[0], hctx, packs[split[0].name], split=False)} if PACK else {base})"
    return f"NUM_SPLITS or _auto_splits({base}, _hcdiv(N, BLOCK_N), {device})"


def _constexpr_values(sig: Signature) -> str:
    """The head-pad check and the constexprs derived from the shapes and scalars (PAD_*, HEAD_PAD_V, EVEN_*, POS_*)."""
    lines = [f"        {pad} = triton.next_power_of_2({pad[4:]})" for pad in sig.pads]
    if VALUE_DIM in sig.dims:
        lines.append(f"        HEAD_PAD_V = max({DOT_MIN_K}, triton.next_power_of_2({VALUE_DIM}))")
    if sig.even_d:
        lines.append("        EVEN_D = HEAD_PAD == D")
    if sig.even_dv:
        lines.append(f"        EVEN_DV = HEAD_PAD_V == {VALUE_DIM}")
    lines += [f"        POS_{name} = {name} > 0" for name in sig.pos_scalars]
    lines += ["        O32 = _o32"] if sig.o32 else []
    lines += ["        ONE_SPLIT = NUM_SPLITS == 1  # the split kernel stores o and lse; no combine (kb.lower.split_direct)"] \
        if sig.direct is not None else []
    lines += ["        SPLIT_Q = len(design) > 8 and bool(design[8])  # Design.q_split"] if sig.q_split else []
    lines += [f"        GQA_GROUP = {sig.gqa_group[0]} // {sig.gqa_group[1]}"] if sig.gqa_group is not None else []
    return (_HEAD_PAD_CHECK if "D" in sig.dims else "") + _block(lines)


def _table_build(p: Program, sig: Signature, plan: BlockMaskPlan, entry: HostEntry, device: str) -> str:
    """Build (or reuse) the block-class table and its block lists; `launch(design, table_only=True)` returns them."""
    assert p.mask_mod is not None
    aux = [q for q in p.params if q.role is Role.AUX]
    scalars = [q for q in p.params if q.role is Role.SCALAR]
    qshape = p.param("q").shape
    used = sorted(free_vars(p.mask_mod.body) & {q.name for q in (*aux, *scalars)} | loaded_tensors(p.mask_mod.body))
    tensors_used = [n for n in used if n in {q.name for q in aux}]
    scalars_used = ", ".join(n for n in used if n in {q.name for q in scalars})
    args = ", ".join([q.name for q in aux] + [f"*{q.name}.stride()" for q in aux] + list(sig.dims)
                     + [q.name for q in scalars] + ["bc", "*bc.stride()", "*bc.shape[1:]"])
    key = f"{entry.table_tag}BLOCK_M, BLOCK_N, {', '.join(sig.dims)}, {scalars_used}{',' if scalars_used else ''}"
    return _TABLE.substitute(class_kernel=entry.class_kernel, args=args, key=key,
                             by_kv=", by_kv=True" if sig.q_lists else "", unpack="bc, kvl, qvl" if sig.q_lists else "bc, kvl",
                             inputs=", ".join(tensors_used) + ("," if tensors_used else ""),
                             nb=str(qshape[0]) if plan.per_b else "1", nh=str(qshape[1]) if plan.per_h else "1",
                             m=qshape[2], n=p.param("k").shape[2], device=device)


def _allocations(p: Program, sig: Signature, entry: HostEntry, device: str) -> list[str]:
    """The outputs (in the inputs' dtype where they follow it), o's fp32 copy when asked (`_o32`; else o itself
    stands in for the pointer the kernels do not use) and the scratch tensors; accumulated ones zeroed."""
    first_in = next(q for q in p.params if q.role is Role.IN)
    lines = []
    for q in (q for q in p.params if q.role is Role.OUT):
        lines.append(_allocation(q, out_dtype(q, first_in), entry, device))
        if q.name == "o" and sig.o32:
            lines.append(_allocation(q, "torch.float32", entry, device, name="o32") + " if _o32 else o")
    for q in (q for q in p.params if q.role is Role.SCRATCH):
        lines.append(_allocation(q, TORCH_DTYPE[q.dtype], entry, device))
    return lines


def _allocation(q: Param, dtype: str, entry: HostEntry, device: str, name: str | None = None) -> str:
    """`name` (default q's) = a tensor of q's shape in `dtype`, zero-filled where the kernels accumulate into q."""
    alloc = "zeros" if q.name in entry.zeroed else "empty"
    return (f"        {name or q.name} = _kb_alloc(rec, torch.{alloc}, ({', '.join(str(d) for d in q.shape)},), {dtype}, "
            f"{device})")


def _tma_choice(p: Program, sig: Signature) -> str:
    """USE_TMA (and WARP_SPEC): decided at launch from the GPU and the tensors' layouts."""
    out = ""
    if sig.tma:
        sides = "BLOCK_M, BLOCK_N, HEAD_PAD" + (", HEAD_PAD_V" if VALUE_DIM in sig.dims else "")
        out += _TMA.substitute(tensors=_tuple_body(sig.tma_tensors), sides=sides)
    if sig.ws:
        out += f"        WARP_SPEC = USE_TMA and {bool(p.schedule.warp_specialize)}\n"
    return out


_SWAP = '''        if len(design) > 7 and design[7]:  # dq_swap: this Q-outer kernel's tile is the transpose of the dK/dV kernel's
            BLOCK_M, BLOCK_N = BLOCK_N, BLOCK_M
'''


def _launches(p: Program, sig: Signature, hctx: ExprContext, packs: dict | str, device: str,
              swap: tuple[str, ...] = ()) -> str:
    """Every kernel's launch with the shared argument list; the packed form first, under `if PACK:`; the kernels in
    `swap` between two exchanges of BLOCK_M and BLOCK_N when the design asks for it (Design.dq_swap); HEAVY_FIRST
    per launch, from that launch's grid (`_longest_first`)."""
    table_args = ["bc", "*bc.stride()", "*bc.shape", "kvl", "*kvl.stride()"] if sig.table else []
    table_args += ["qvl", "*qvl.stride()"] if sig.q_lists else []
    args = ", ".join([q.name for q in sig.tensors] + [f"*{q.name}.stride()" for q in sig.tensors] + list(sig.dims)
                     + sig.runtime_scalars() + table_args + (["o32"] if sig.o32 else []))
    def constexprs(grid: str) -> str:
        return ", ".join(f"{c}=_longest_first({grid}, {device})" if c == "HEAVY_FIRST" else f"{c}={c}"
                         for c in sig.constexprs())

    direct = sig.direct
    out = ""
    for k in p.kernels:
        skip = direct is not None and k.name == direct.combine
        pad = "    " if skip else ""
        out += "        if not ONE_SPLIT:\n" if skip else ""
        grid = _grid_code(k, hctx, None)
        plain = dict(fn=kernel_fn_name(k), grid=grid, args=args, constexprs=constexprs(grid))
        if not isinstance(packs, dict):
            launch = _KERNEL_LAUNCH.substitute(indent="        " + pad, **plain)
            out += _SWAP + launch + _SWAP if k.name in swap else launch
            continue
        packed_grid = _grid_code(k, hctx, packs[k.name])
        packed = dict(plain, fn=packed_fn_name(k), grid=packed_grid, constexprs=constexprs(packed_grid))
        out += f"        {pad}if PACK:\n" + _KERNEL_LAUNCH.substitute(indent="            " + pad, **packed)
        out += f"        {pad}else:\n" + _KERNEL_LAUNCH.substitute(indent="            " + pad, **plain)
    return out
