"""CUDA lowering: every fixture lowers to CUDA C++ that nvcc compiles for sm_90, golden sources match.

Also: expression semantics (floor `//` and `%` for negative operands, cdiv, true division,
where/maximum promotion, math calls) checked by compiling the lowered expressions into a host
program with nvcc and running it; typed build results for broken sources; the launch ABI
(block-class table only when no closed form exists); clear errors for unsupported programs
and for running without a GPU. On a machine with a GPU the fixtures also run against the
dense oracle. Regenerate golden files with KB_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kb.errors import KBError
from kb.ir.evaluate import eval_expr
from kb.ir.expr import parse_expr
from kb.ir.nodes import Dtype, For, Full, Kernel, Load, Program, Role
from kb.lower.cuda import HEAD_PADS, launch_abi, lower_program
from kb.lower.cuda_build import BuildMode, BuildStatus, build
from kb.lower.cuda_expr import EXPR_HELPERS, lower_cexpr
from kb.lower.cuda_runtime import CudaKernel
from kb.lower.expr_context import ExprContext, ExprTarget, Kind, Sym
from tests.support.cuda import nvcc_or_skip
from tests.support.attn_reference import reference_attention
from tests.support.ir_programs import FIXTURES, causal

GOLDEN = Path(__file__).parent / "golden" / "cuda"
UPDATE_GOLDEN = os.environ.get("KB_UPDATE_GOLDEN") == "1"  # read at import: conftest clears KB_* per test


def _reverse(p: Program) -> Program:
    """`p` with its KV loop iterated in reverse (the IR's `reverse` order)."""
    k = p.kernels[0]
    body = tuple(dataclasses.replace(st, order="reverse") if isinstance(st, For) else st for st in k.body)
    return dataclasses.replace(p, name=p.name + "_reverse", kernels=(dataclasses.replace(k, body=body),))


FULL_DISPATCH = {"plain"}


def _compile_set() -> dict[str, Program]:
    progs = {name: build_fn() for name, build_fn in FIXTURES.items()}
    progs["document_bf16"] = FIXTURES["document"](dtype=Dtype.BF16)
    progs["causal_reverse"] = _reverse(causal())
    return progs


# ------------------------------------------------------------------ golden sources


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_golden_source(name: str) -> None:
    source = lower_program(FIXTURES[name]())
    path = GOLDEN / f"{name}.cu"
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    assert path.exists(), f"missing golden file {path}; run with KB_UPDATE_GOLDEN=1"
    assert source == path.read_text(), f"generated CUDA for {name} changed; review, then KB_UPDATE_GOLDEN=1"


def test_lowering_is_deterministic() -> None:
    p = FIXTURES["document"]()
    assert lower_program(p) == lower_program(p)


# ------------------------------------------------------------------ nvcc compiles every fixture


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    nvcc_or_skip()
    out = tmp_path_factory.mktemp("cuda_objects")
    progs = _compile_set()


    def compile_one(name: str) -> tuple[str, object]:
        # `plain` compiles the full HEAD_PAD dispatch; the rest one instantiation each, to keep the file fast
        defines = () if name in FULL_DISPATCH else ("KB_HEAD_PAD_ONLY=32",)
        return name, build(lower_program(progs[name]), out, BuildMode.OBJECT, name=name, defines=defines)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:  # nvcc runs outside the GIL
        return dict(pool.map(compile_one, progs))


@pytest.mark.parametrize("name", sorted(_compile_set()))
def test_nvcc_compiles(compiled: dict, name: str) -> None:
    result = compiled[name]
    assert result.status is BuildStatus.OK, result.log
    assert result.artefact is not None and result.artefact.stat().st_size > 0
    assert "-arch=sm_90" in result.command and "-c" in result.command
    if name not in FULL_DISPATCH:
        assert "-DKB_HEAD_PAD_ONLY=32" in result.command
    assert "warning" not in result.log.lower(), result.log  # generated code compiles cleanly


def test_every_launch_names_a_shared_memory_overflow() -> None:
    """A design whose tiles need more shared memory than the GPU allows gets a named error, not "invalid argument"
    (run 20: the portable `.cu` of D=64 / D_v=128 at 128x128 needed ~333 KB on an H100)."""
    for name, make in FIXTURES.items():
        src = lower_program(make())
        launches = src.count("<<<(unsigned)kb_grid")
        assert launches and src.count("return kb_smem > kb_smem_per_block() ? KB_ERR_SMEM : (int)kb_err;") == launches, name
        assert "if (code == KB_ERR_SMEM) return" in src


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiles_too_large_for_shared_memory_are_a_named_error(tmp_path: Path) -> None:
    p = causal()
    p = dataclasses.replace(p, schedule=dataclasses.replace(p.schedule, block_m=256, block_n=256))
    kernel = CudaKernel.from_program(p, tmp_path)
    qkv = {n: torch.randn(1, 1, 300, 256, device="cuda") for n in "qkv"}
    with pytest.raises(KBError, match="more shared memory per block than this GPU allows"):
        kernel.run(qkv)


def test_object_holds_every_head_pad_instantiation(compiled: dict) -> None:
    result = compiled["plain"]
    symbols = subprocess.run(["nm", "-C", str(result.artefact)], capture_output=True, text=True)
    if symbols.returncode != 0:
        pytest.skip("nm is not available")
    for hp in HEAD_PADS:
        assert f"kb_fwd_kernel<{hp}>" in symbols.stdout
    assert "kb_launch" in symbols.stdout and "kb_error_string" in symbols.stdout


def test_build_reports_compile_errors(tmp_path: Path) -> None:
    nvcc_or_skip()
    result = build("__global__ void broken() { undeclared_name = 1; }\n", tmp_path, BuildMode.OBJECT, name="broken")
    assert result.status is BuildStatus.COMPILE_ERROR and not result.ok
    assert "undeclared_name" in result.log and result.artefact is None
    assert not list(tmp_path.glob("*.o")) and not list(tmp_path.glob(".*.tmp"))


def test_build_is_cached_by_content(tmp_path: Path) -> None:
    nvcc_or_skip()
    src = "__global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n"
    first = build(src, tmp_path, BuildMode.OBJECT, name="tiny")
    again = build(src, tmp_path, BuildMode.OBJECT, name="tiny")
    assert first.ok and not first.cached and again.cached and again.artefact == first.artefact


# ------------------------------------------------------------------ expression semantics, run on the host


_EXPRS = [
    "a // b", "a % b", "cdiv(a, b)", "a / b", "-a // b", "maximum(a, x)", "minimum(a, b) * 2",
    "where(a > b, a, x)", "abs(a - b)", "tanh(x) + sigmoid(x)", "exp(x) - log(abs(x) + 1)", "sqrt(abs(x))",
    "x // 0.75", "x % 0.75", "(a >= 0) & ~(b < 0) | (a == b)", "exp2(x) * (a != b)",
    "trunc(x * 3.0) + trunc(-x)", "trunc(a / b) * 2 + trunc(a)", "trunc(a > b) - trunc(x)",
]
_VALUES = [(7, 2, 1.5), (-7, 2, -1.25), (7, -2, 0.5), (-7, -2, -2.0), (0, 3, 0.0), (-1, 5, 3.0), (6, 3, -0.3)]


def test_expressions_keep_python_semantics(tmp_path: Path) -> None:
    nvcc = nvcc_or_skip()
    ctx = ExprContext(ExprTarget.HOST, {"a": Sym("a", Kind.INT), "b": Sym("b", Kind.INT), "x": Sym("x", Kind.FLOAT)})
    exprs = [parse_expr(t) for t in _EXPRS]
    body = [f'      printf("%.9g\\n", (double)({lower_cexpr(e, ctx)}));' for e in exprs]
    rows = ", ".join(f"{{{a}LL, {b}LL, {x}f}}" for a, b, x in _VALUES)
    src = "\n".join([
        "#include <cstdio>", "#include <cuda_runtime.h>", "#include <cuda_bf16.h>", "#include <cuda_fp16.h>",
        "#include <math.h>", EXPR_HELPERS,
        "struct Row { long long a, b; float x; };",
        "int main() {", f"  const Row rows[] = {{{rows}}};",
        "  for (const Row& r : rows) {", "    { const long long a = r.a, b = r.b; const float x = r.x;",
        *body, "    }", "  }", "  return 0;", "}",
    ])
    (tmp_path / "exprs.cu").write_text(src)
    exe = tmp_path / "exprs"
    subprocess.run([nvcc, "-std=c++17", "-o", str(exe), str(tmp_path / "exprs.cu")], check=True, capture_output=True)
    got = [float(line) for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    want = []
    for a, b, x in _VALUES:
        for e in exprs:
            v = eval_expr(e, {"a": a, "b": b, "x": torch.tensor(x, dtype=torch.float32)})
            want.append(float(v))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        e, row = _EXPRS[i % len(_EXPRS)], _VALUES[i // len(_EXPRS)]
        assert math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-5), f"{e} at (a, b, x) = {row}: C++ {g}, Python {w}"


def test_unknown_names_raise() -> None:
    ctx = ExprContext(ExprTarget.DEVICE, {"a": Sym("a", Kind.INT)})
    with pytest.raises(KBError, match="not visible"):
        lower_cexpr(parse_expr("a + nope"), ctx)


# ------------------------------------------------------------------ launch ABI and limits


def test_launch_abi_orders_arguments_and_plans_tables() -> None:
    doc = launch_abi(FIXTURES["document"]())
    assert [t.name for t in doc.tensors] == ["q", "k", "v", "o", "lse", "doc_ids"]
    assert doc.dims == ("B", "Hq", "M", "D", "Hkv", "N") and doc.scalars == ("sm_scale",)
    assert doc.table is not None and doc.table.per_b and not doc.table.per_h  # doc ids depend on b only
    assert doc.table.shape({"B": 2, "Hq": 4, "M": 33, "N": 17}) == (2, 1, 3, 2)
    assert launch_abi(causal()).table is None  # causal blocks are classified in closed form
    split = launch_abi(FIXTURES["decode_split_kv"]())
    assert {t.name: t.role for t in split.tensors}["o_part"] is Role.SCRATCH


def test_table_kernel_only_when_needed() -> None:
    assert "kb_block_class_kernel" in lower_program(FIXTURES["document"]())
    src = lower_program(causal())
    assert "kb_block_class_kernel" not in src and "block class in closed form" in src


def test_full_over_runtime_dim_is_refused() -> None:
    p = FIXTURES["plain"]()
    k = p.kernels[0]
    body = tuple(dataclasses.replace(st, index=st.index[:2] + (Full(), Full())) if isinstance(st, Load) and st.out == "qt"
                 else st for st in k.body)
    bad = dataclasses.replace(p, kernels=(Kernel(k.name, k.grid, body),))
    with pytest.raises(KBError, match="runtime dim 'M'"):
        lower_program(bad)


def test_runtime_needs_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")

    with pytest.raises(KBError, match="CUDA kernels need a GPU"):
        CudaKernel.from_program(causal())


# ------------------------------------------------------------------ on a GPU: fixtures vs oracle


_GPU_SHAPES = {"gqa": (2, 4, 2, 37, 29, 24), "document": (2, 2, 2, 29, 37, 24), "decode_split_kv": (2, 2, 2, 3, 45, 16)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,dtype", list(itertools.product(sorted(FIXTURES), [Dtype.F32, Dtype.BF16])))
def test_gpu_matches_oracle(name: str, dtype: Dtype, tmp_path_factory: pytest.TempPathFactory) -> None:
    p = FIXTURES[name](dtype=dtype)
    B, Hq, Hkv, M, N, D = _GPU_SHAPES.get(name, (2, 2, 2, 37, 29, 24))
    tdt = {Dtype.F32: torch.float32, Dtype.BF16: torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(0)
    qkv = {"q": torch.randn(B, Hq, M, D, generator=g).to(tdt), "k": torch.randn(B, Hkv, N, D, generator=g).to(tdt),
           "v": torch.randn(B, Hkv, N, D, generator=g).to(tdt)}
    scalars = {q.name: 2.5 for q in p.params if q.role is Role.SCALAR and q.name != "sm_scale"}
    aux = {}
    if any(q.name == "slopes" for q in p.params):
        aux["slopes"] = torch.rand(Hq, generator=g)
    if any(q.name == "doc_ids" for q in p.params):
        aux["doc_ids"] = torch.sort(torch.randint(0, 3, (B, N), generator=g), dim=1).values.to(torch.int32)
    kernel = CudaKernel.from_program(p, tmp_path_factory.mktemp("cuda_lib"))
    out = kernel.run({**{k: v.cuda() for k, v in {**qkv, **aux}.items()}, **scalars})
    o_ref, lse_ref = reference_attention(p, qkv["q"], qkv["k"], qkv["v"], scalars=scalars, aux=aux)
    tol = 1e-4 if dtype is Dtype.F32 else 2e-2
    assert out["o"].dtype == tdt and out["lse"].dtype == torch.float32
    torch.testing.assert_close(out["o"].float().cpu(), o_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out["lse"].cpu(), lse_ref, atol=tol, rtol=tol)
