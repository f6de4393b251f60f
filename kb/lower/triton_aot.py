"""Compile a lowered program's Triton kernels for a CUDA arch without a GPU (ahead of time).

The Triton interpreter checks semantics on CPU but never runs Triton's GPU compiler, so code
that is valid Python yet fails to compile (a type error in the compiled dialect, shared memory
over the limit, a pass crash) would only surface on the GPU machine. `compile_for_arch` runs the
real compiler (`triton.compile` with a `GPUTarget`, Triton's bundled ptxas) on this machine, with
concrete constexprs taken from the program's schedule, and reports what the GPU would get.

Why a child process: Triton decides interpreter or compiler once per function, when `@triton.jit`
decorates it (`knobs.runtime.interpret`, read from `TRITON_INTERPRET` at that moment). Triton's
own library functions (`tl.cdiv`, `tl.sum`, ...) are decorated when `triton.language` is first
imported, so a process that ever imported Triton with `TRITON_INTERPRET=1` holds interpreter
versions of them for good, and the compiler fails on the first call into one ("'block_argument'
object has no attribute 'dtype'"). Unsetting the variable later cannot undo that; only a process
that never set it can compile. The compile therefore always runs in a fresh interpreter with the
variable removed from its environment, whatever the calling process did before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kb.errors import KBError
from kb.ir.nodes import DOT_MIN_K, Dtype, Program, Role
from kb.ir.text import parse_program, print_program
from kb.lower.runtime import load_module
from kb.lower.serving import layout_scalars
from kb.lower.triton import LowerOptions, lower_program
from kb.lower.triton_host import kernel_fn_name

__all__ = ["AotKernel", "compile_for_arch", "read_sass"]

_PTR = {Dtype.F32: "*fp32", Dtype.BF16: "*bf16", Dtype.F16: "*fp16", Dtype.I32: "*i32", Dtype.I64: "*i64", Dtype.BOOL: "*i1"}
_TABLE_PTRS = {"bc_ptr": "*i8", "kvl_ptr": "*i32", "qvl_ptr": "*i32"}
PAGE_SIZE = 16  # the page size a compiled-in layout scalar gets (vLLM's default block size)


@dataclass(frozen=True)
class AotKernel:
    name: str
    shared_bytes: int
    wgmma: int  # wgmma.mma_async instructions in the PTX (Hopper tensor cores)
    tma_loads: int  # cp.async.bulk.tensor instructions (TMA copies)
    ttir_ops_digest: str  # sha256 of the Triton IR's operations in order (names, not values): the same program
    sass_digest: str  # sha256 of the SASS instructions (cuobjdump): equal digests, equal machine code
    sass_instructions: int
    local_stores: int  # STL instructions: register spills
    tanh_approx: int = 0  # tanh.approx.f32 instructions in the PTX (the one-MUFU tanh a softcap lowers to)


def _sha(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def read_sass(cubin: bytes) -> list[str]:
    """A cubin's SASS instructions with their operands, without addresses, encodings and line info (which change
    with the source's layout, not the code); by the cuobjdump Triton bundles."""
    import triton.backends.nvidia  # noqa: PLC0415  in the compile child only (module docstring)

    tool = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"/\*[0-9a-f]+\*/|;.*", "", line).strip() for line in sass.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]


def compile_for_arch(p: Program, *, arch: int = 90, head_dim: int = 128, tma: bool = True,
                     options: LowerOptions | None = None, timeout_s: float = 300.0,
                     head_dim_v: int | None = None, source: str | None = None, split_q: bool = False) -> list[AotKernel]:
    """Compile every kernel of `p` for sm_`arch` as the host would launch it at `head_dim` (and value head dim
    `head_dim_v`, default `head_dim`, for a program with a `Dv`) with USE_TMA=`tma` (and a backward's SPLIT_Q=`split_q`); `source`: a module lowered
    from `p` elsewhere (another version of the lowering, say) to compile instead of lowering `p` here."""
    request = {"ir": print_program(p), "arch": arch, "head_dim": head_dim, "head_dim_v": head_dim_v or head_dim, "tma": tma,
               "options": dataclasses.asdict(options or LowerOptions()), "source": source, "split_q": split_q}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        done = subprocess.run([sys.executable, "-m", "kb.lower.triton_aot"], input=json.dumps(request), env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        raise KBError(f"{p.name}: the Triton compile for sm_{arch} took over {timeout_s:.0f} s") from err
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):  # the child died before answering: show the end of what it said
        tail = "\n".join(done.stderr.strip().splitlines()[-20:])
        raise KBError(f"{p.name}: the Triton compile process failed (exit status {done.returncode}):\n{tail}") from None
    if "error" in answer:
        raise KBError(answer["error"])
    return [AotKernel(**k) for k in answer["kernels"]]


def _compile_here(p: Program, arch: int, head_dim: int, tma: bool, options: LowerOptions,
                  head_dim_v: int, source: str | None, split_q: bool) -> list[AotKernel]:
    """The compile itself; runs only in a process whose Triton was imported without TRITON_INTERPRET."""
    import triton  # noqa: PLC0415  in the compile child only: the caller may interpret Triton (module docstring)
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415  as triton
    from triton.compiler import ASTSource  # noqa: PLC0415  as triton

    module = load_module(source or lower_program(p, options), p.name)[0]
    tensors = {f"{q.name}_ptr": _PTR[q.dtype] for q in p.params if q.role is not Role.SCALAR} | {"o32_ptr": "*fp32"}
    float_scalars = {q.name for q in p.params if q.role is Role.SCALAR and q.dtype in (Dtype.F32, Dtype.BF16, Dtype.F16)}
    s = p.schedule
    head_pad = s.head_pad_for(head_dim, DOT_MIN_K)
    head_pad_v = s.value_head_pad_for(head_dim_v, DOT_MIN_K)
    consts = {**s.tile_constants(), "HEAD_PAD": head_pad,
              "EVEN_D": head_pad == head_dim, "USE_TMA": tma, "WARP_SPEC": tma and s.warp_specialize,
              "HEAD_PAD_V": head_pad_v, "EVEN_DV": head_pad_v == head_dim_v, "O32": False,
              "SPLIT_Q": split_q, "GQA_GROUP": 1, "ONE_SPLIT": s.num_splits == 1,
              "HEAVY_FIRST": False}
    layout = set(layout_scalars(p))  # compiled-in layout sizes: a page size
    out = []
    for k in p.kernels:
        fn = getattr(module, kernel_fn_name(k))
        sig: dict[str, str] = {}
        for name in fn.arg_names:
            if name in tensors or name in _TABLE_PTRS:
                sig[name] = tensors.get(name) or _TABLE_PTRS[name]
            elif name in consts or name in layout or name.startswith(("POS_", "PAD_")):
                sig[name] = "constexpr"
            else:
                sig[name] = "fp32" if name in float_scalars else "i32"  # integer scalars (a max_seq_len) as the host passes them
        values = {n: consts.get(n, True if n.startswith("POS_") else PAGE_SIZE if n in layout else 64)
                  for n, t in sig.items() if t == "constexpr"}
        try:
            compiled = triton.compile(ASTSource(fn, sig, values), target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": s.num_warps, "num_stages": s.num_stages})
        except Exception as err:  # the compiler's own error, with the kernel named
            raise KBError(f"{p.name}/{k.name}: Triton does not compile it for sm_{arch}: {err}") from err
        ptx, sass = compiled.asm["ptx"], read_sass(compiled.asm["cubin"])
        ops = re.findall(r"\b(?:tt|ttg|ttng|arith|math|scf|cf)\.[a-z_]+", re.sub(r"(?m)^#loc.*$|loc\([^)]*\)", "", compiled.asm["ttir"]))
        out.append(AotKernel(k.name, compiled.metadata.shared, ptx.count("wgmma.mma_async"), ptx.count("cp.async.bulk.tensor"),
                             _sha(ops), _sha(sass), len(sass), sum(x.startswith("STL") for x in sass),
                             ptx.count("tanh.approx.f32")))
    return out


def _main() -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("kb.lower.triton_aot must run without TRITON_INTERPRET", file=sys.stderr)
        return 2
    req = json.loads(sys.stdin.read())
    try:
        kernels = _compile_here(parse_program(req["ir"]), req["arch"], req["head_dim"], req["tma"],
                                LowerOptions(**req["options"]), req["head_dim_v"], req.get("source"), req.get("split_q", False))
    except KBError as err:
        print(json.dumps({"error": str(err)}))
        return 1
    print(json.dumps({"kernels": [dataclasses.asdict(k) for k in kernels]}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
