"""Run every IR fixture through the CUDA lowering on a GPU and compare with the dense fp32 oracle.

Usage (on a GPU machine, from the repo root):
    python3 bench/cuda_check.py [--dtypes f32,bf16] [--only causal,document] [--time]
    python3 bench/cuda_check.py --tensor-cores [--traits 128x64x4,64x64x4] [--time] [--json OUT]

`--tensor-cores` checks and times the FA2-structured lowering (kb.lower.cuda_mma) instead of the
portable SIMT one, once per `--traits` entry (BLOCK_M x BLOCK_N x num_warps); fp32 fixtures and
programs it declines (split-KV) are reported as DECLINED, not failures. Its `--time` times the
causal/plain/alibi/sliding_window/document fixtures at S = 2048 and 8192, D = 64 and 128, bf16,
beside SDPA's flash and cuDNN backends (causal, or none for plain) in one process.

For each fixture x dtype x shape it prints the max |error| of o and lse against
`tests/support/attn_reference.py` (computed on CPU in fp32), NaN counts, and PASS/FAIL at the
dtype's tolerance; `--time` adds the median runtime of a larger bf16 causal/plain case next to
torch SDPA, for each `--schedules` entry (BLOCK_M x BLOCK_N x num_warps). Exit status 0 only when every case passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from kb.ir.nodes import Dtype, Program, Role  # noqa: E402
from kb.errors import KBError  # noqa: E402
from kb.lower.cuda_mma import MmaTraits, with_traits  # noqa: E402
from kb.lower.cuda_runtime import CudaKernel  # noqa: E402
from kb.lower.cuda_sm90_ir import lower_program_sm90  # noqa: E402
from tests.support.attn_reference import reference_attention  # noqa: E402
from tests.support.ir_programs import FIXTURES  # noqa: E402

TORCH = {Dtype.F32: torch.float32, Dtype.BF16: torch.bfloat16, Dtype.F16: torch.float16}
TOL = {Dtype.F32: 1e-4, Dtype.BF16: 2e-2, Dtype.F16: 5e-3}
# (B, Hq, Hkv, M, N, D): ragged lengths, several head dims (so several HEAD_PAD instantiations)
SHAPES = [(2, 2, 2, 37, 29, 24), (1, 4, 2, 64, 64, 64), (2, 2, 1, 100, 130, 128)]
SPECIAL = {"gqa": [(2, 4, 2, 37, 29, 24), (1, 8, 2, 70, 90, 64)],
           "document": [(2, 2, 2, 29, 37, 24), (1, 2, 2, 100, 130, 128)],
           "decode_split_kv": [(2, 2, 2, 3, 45, 16), (1, 4, 2, 1, 300, 128)]}


def make_inputs(p: Program, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[dict, dict, dict]:
    B, Hq, Hkv, M, N, D = shape
    g = torch.Generator().manual_seed(seed)
    qkv = {"q": torch.randn(B, Hq, M, D, generator=g).to(dtype), "k": torch.randn(B, Hkv, N, D, generator=g).to(dtype),
           "v": torch.randn(B, Hkv, N, D, generator=g).to(dtype)}
    scalars = {q.name: 2.5 for q in p.params if q.role is Role.SCALAR and q.name != "sm_scale"}
    aux = {}
    for q in p.params:
        if q.name == "slopes":
            aux["slopes"] = torch.rand(Hq, generator=g)
        elif q.name == "doc_ids":
            aux["doc_ids"] = torch.sort(torch.randint(0, 3, (B, N), generator=g), dim=1).values.to(torch.int32)
    return qkv, scalars, aux


TRAITS: MmaTraits | None = None  # --tensor-cores: the traits of the kernel under test
SM90 = False  # --sm90: the Hopper template with hooks from the IR (kb.lower.cuda_sm90_ir), built per head dim
SM90_SHAPES = [(1, 4, 2, 64, 64, 64), (2, 2, 1, 100, 130, 128), (2, 4, 2, 300, 520, 128), (1, 8, 2, 333, 200, 64)]


def _kernel(name: str, dtype: Dtype, cache: Path, head_dim: int = 0) -> CudaKernel:
    p = FIXTURES[name](dtype=dtype)
    if SM90:
        return CudaKernel.from_source(p, lower_program_sm90(p, head_dim), cache)
    if TRAITS is None:
        return CudaKernel.from_program(p, cache)
    return CudaKernel.from_program(with_traits(p, TRAITS), cache, tensor_cores=True)


def check(name: str, dtype: Dtype, cache: Path) -> bool:
    p = FIXTURES[name](dtype=dtype)
    t0 = time.perf_counter()
    kernels: dict[int, CudaKernel] = {}
    shapes = SM90_SHAPES if SM90 else SPECIAL.get(name, SHAPES)
    if SM90 and name == "document":  # its doc ids are [B, N], read at q_idx too
        shapes = [s for s in shapes if s[3] <= s[4]]
    try:
        kernel = _kernel(name, dtype, cache, shapes[0][-1])
        kernels[shapes[0][-1]] = kernel
    except KBError as err:
        if (TRAITS is not None or SM90) and ("lowering of" in str(err)):
            print(f"{name:16s} {dtype.value:5s} DECLINED {str(err)[:200]}", flush=True)
            return True
        raise
    build_s = time.perf_counter() - t0
    ok_all = True
    for i, shape in enumerate(shapes):
        if SM90 and shape[-1] not in kernels:
            kernels[shape[-1]] = _kernel(name, dtype, cache, shape[-1])
        kernel = kernels.get(shape[-1], kernel)
        qkv, scalars, aux = make_inputs(p, shape, TORCH[dtype], seed=i)
        dev = {k: v.cuda() for k, v in {**qkv, **aux}.items()}
        out = kernel.run({**dev, **scalars})
        torch.cuda.synchronize()
        o_ref, lse_ref = reference_attention(p, qkv["q"], qkv["k"], qkv["v"], scalars=scalars, aux=aux)
        o, lse = out["o"].float().cpu(), out["lse"].cpu()
        nan = int(torch.isnan(o).sum() + torch.isnan(lse).sum())
        err_o = (o - o_ref).abs().max().item()
        finite = torch.isfinite(lse_ref)
        inf_ok = bool(torch.equal(torch.isfinite(lse), finite))
        err_lse = (lse[finite] - lse_ref[finite]).abs().max().item() if finite.any() else 0.0
        tol = TOL[dtype]
        ok = nan == 0 and inf_ok and err_o <= tol * 5 and err_lse <= tol * 5 and \
            torch.allclose(o, o_ref, atol=tol, rtol=tol)
        ok_all &= ok
        print(f"{name:16s} {dtype.value:5s} {str(shape):28s} max|do|={err_o:.2e} max|dlse|={err_lse:.2e} "
              f"nan={nan} -inf rows match={inf_ok} build={build_s:5.1f}s {'PASS' if ok else 'FAIL'}", flush=True)
        build_s = 0.0
    return ok_all


def bench(cache: Path, schedules: list[tuple[int, ...]]) -> None:  # (BLOCK_M, BLOCK_N, num_warps) each
    B, H, S, D = 2, 16, 2048, 128
    for (bm, bn, warps), name in itertools.product(schedules, ("plain", "causal")):
        p = FIXTURES[name](dtype=Dtype.BF16)
        p = dataclasses.replace(p, schedule=dataclasses.replace(p.schedule, block_m=bm, block_n=bn, num_warps=warps))
        kernel = CudaKernel.from_program(p, cache)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ms = _time(lambda: kernel.run({"q": q, "k": k, "v": v}))
        ref = _time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=name == "causal"))
        flops = 4 * B * H * S * S * D / (2 if name == "causal" else 1)
        print(f"time {name:8s} bf16 B={B} H={H} S={S} D={D} block {bm}x{bn} warps={warps}: kb-cuda {ms:.3f} ms ({flops / ms / 1e9:.1f} TFLOP/s), "
              f"sdpa {ref:.3f} ms ({flops / ref / 1e9:.1f} TFLOP/s)", flush=True)


def bench_mma(cache: Path, traits: list[MmaTraits], out: dict) -> None:
    """Tensor-core kernels of the variant fixtures beside SDPA flash / cuDNN (causal for the masked variants)."""
    rows = out.setdefault("timings", [])
    for D, S, name in itertools.product((64, 128), (2048, 8192), ("plain", "causal", "alibi", "sliding_window", "document")):
        B, H = (4, 16) if S == 2048 else (1, 16)
        p = FIXTURES[name](dtype=Dtype.BF16)
        qkv, scalars, aux = make_inputs(p, (B, H, H, S, S, D), torch.bfloat16, seed=0)
        dev = {k: v.cuda() for k, v in {**qkv, **aux}.items()}
        causal = name != "plain"
        q, k, v = dev["q"], dev["k"], dev["v"]
        base = {}
        for be, label in ((SDPBackend.FLASH_ATTENTION, "sdpa_flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn")):
            try:
                with sdpa_kernel([be]):
                    base[label] = _time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), 20)
            except Exception as err:
                print(f"{label} unavailable: {err}", flush=True)
        flops = 4 * B * H * S * S * D / (2 if causal else 1)  # the causal count for every masked variant
        for t in traits:
            try:
                kern = CudaKernel.from_program(with_traits(p, t), cache, tensor_cores=True, defines=(f"KB_HEAD_PAD_ONLY={D}",))
                ms = _time(lambda: kern.run({**dev, **scalars}), 20)
            except Exception as err:
                print(f"time {name} D={D} S={S} {t}: ERROR {str(err)[:300]}", flush=True)
                continue
            row = {"variant": name, "B": B, "H": H, "S": S, "D": D, "traits": str(t), "ms": ms,
                   "tflops_causal_count": flops / ms / 1e9, **{f"{k}_ms": v for k, v in base.items()}}
            rows.append(row)
            rel = " ".join(f"{k} {v:.3f} ms ({v / ms:.2f}x)" for k, v in base.items())
            print(f"time {name:14s} D={D:3d} S={S:5d} B={B} H={H} {str(t):12s} kb-mma {ms:.3f} ms "
                  f"({flops / ms / 1e9:.0f} TFLOP/s causal count) | {rel}", flush=True)


def _time(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _try_build_sm90(name: str, dtype: Dtype, cache: Path, head_dim: int) -> bool:
    try:
        _kernel(name, dtype, cache, head_dim)
        return True
    except Exception as err:
        print(f"{name:16s} {dtype.value:5s} D={head_dim} BUILD: {str(err)[:300]}", flush=True)
        return False


def _try_build(name: str, dtype: Dtype, cache: Path) -> bool:
    try:
        _kernel(name, dtype, cache)
        return True
    except Exception as err:
        print(f"{name:16s} {dtype.value:5s} BUILD ERROR {type(err).__name__}: {str(err)[:2000]}", flush=True)
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--only", default="")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--schedules", default="16x16x4,64x64x4,64x64x8",
                    help="BLOCK_MxBLOCK_Nxnum_warps schedules timed by --time")
    ap.add_argument("--cache", default=str(ROOT / "build" / "cuda_check"))
    ap.add_argument("--tensor-cores", action="store_true", help="the FA2-structured lowering (kb.lower.cuda_mma)")
    ap.add_argument("--traits", default="128x64x4", help="BLOCK_MxBLOCK_Nxnum_warps list for --tensor-cores")
    ap.add_argument("--sm90", action="store_true", help="the Hopper template with hooks from the IR (kb.lower.cuda_sm90_ir)")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device visible: run this on a GPU machine", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    names = [n for n in FIXTURES if not args.only or n in args.only.split(",")]
    dtypes = [Dtype(d) for d in args.dtypes.split(",")]
    if args.sm90:
        global SM90
        SM90 = True
        cases = [(n, d) for d in dtypes if d is not Dtype.F32 for n in names]
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 2)) as pool:  # nvcc in parallel, first
            list(pool.map(lambda c: [_try_build_sm90(c[0], c[1], Path(args.cache), hd) for hd in (64, 128)], cases))
        ok = True
        for n, d in cases:
            try:
                ok &= check(n, d, Path(args.cache))
            except Exception as err:
                ok = False
                print(f"{n:16s} {d.value:5s} ERROR {type(err).__name__}: {str(err)[:2000]}", flush=True)
        print("ALL PASS" if ok else "SOME FAILED", flush=True)
        return 0 if ok else 1
    if args.tensor_cores:
        return _main_mma(args, names, [d for d in dtypes if d is not Dtype.F32])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) // 2)) as pool:  # nvcc runs outside the GIL
        built = list(pool.map(lambda nd: _try_build(nd[0], nd[1], Path(args.cache)), itertools.product(names, dtypes)))
    print(f"built {sum(built)}/{len(built)} programs in {time.perf_counter() - t0:.1f} s", flush=True)
    ok = True
    for dt in dtypes:
        for name in names:
            try:
                ok &= check(name, dt, Path(args.cache))
            except Exception as err:  # report and go on: one broken fixture should not hide the rest
                ok = False
                print(f"{name:16s} {dt.value:5s} ERROR {type(err).__name__}: {str(err)[:2000]}", flush=True)
    if args.time:
        bench(Path(args.cache), [tuple(int(x) for x in sch.split("x")) for sch in args.schedules.split(",")])
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


def _main_mma(args: argparse.Namespace, names: list[str], dtypes: list[Dtype]) -> int:
    global TRAITS
    traits = [MmaTraits(*(int(x) for x in t.split("x"))) for t in args.traits.split(",")]
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": []}
    ok = True
    for t in traits:
        TRAITS = t
        with ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) // 2)) as pool:
            list(pool.map(lambda nd: _try_build(nd[0], nd[1], Path(args.cache)), itertools.product(names, dtypes)))
        for dt, name in itertools.product(dtypes, names):
            try:
                passed = check(name, dt, Path(args.cache))
            except Exception as err:
                passed = False
                print(f"{name:16s} {dt.value:5s} {t} ERROR {type(err).__name__}: {str(err)[:2000]}", flush=True)
            out["checks"].append({"traits": str(t), "fixture": name, "dtype": dt.value, "passed": passed})
            ok &= passed
        print(f"traits {t}: {'pass' if ok else 'FAIL'}", flush=True)
    if args.time:
        bench_mma(Path(args.cache), traits, out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
