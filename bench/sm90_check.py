"""Check and time the Hopper (sm_90a) attention forward of kb.lower.cuda_sm90 on an H100/H200.

Usage (on the GPU machine, from the repo root):
    python3 bench/sm90_check.py --quick                 # one correctness shape per case, no timing
    python3 bench/sm90_check.py                         # all shapes + timing beside torch SDPA
    python3 bench/sm90_check.py --schedules serial      # only the plain (no overlap, no ping-pong) schedule

Builds one .so per (schedule, mask in {causal, plain}, D in {64, 128}) with nvcc (sm_90a), in
parallel; a failed build prints nvcc's log and the others go on. Each library is loaded with
ctypes and called through `kb_sm90_launch(KbArgs*, stream)`. Correctness is against an fp32
reference from the same bf16 inputs: max |o - ref| <= 2e-2 and max |lse - logsumexp| <= 1e-2;
a failing case prints where the bad entries are (first one, rows mod 128, columns) to tell a
fragment-layout error from a masking or pipeline error. A kernel that has not finished after
--hang-s seconds is reported as a hang and the script exits at once (a hung kernel owns the
context), with the JSON written so far. Schedules run from the simplest up, so a hang in a
later one still leaves the earlier results. Exit status 1 on any correctness failure or hang.
Only torch and kb.lower.{cuda_sm90,cuda_build} are imported (no database, no IR).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from kb.lower.cuda_build import BuildMode, build  # noqa: E402
from kb.lower.cuda_sm90 import ERROR_CODES, SM90_ARCH, causal_hooks, plain_hooks, sm90_forward_source  # noqa: E402

SCHEDULES = {  # name -> (overlap, pingpong), simplest first
    "serial": (False, False),
    "pingpong": (False, True),
    "overlap": (True, False),
    "fa3": (True, True),
}
HOOKS = {"causal": causal_hooks, "plain": plain_hooks}
O_TOL, LSE_TOL = 2e-2, 1e-2


class KbArgs(ctypes.Structure):
    """Mirror of `struct KbArgs` in kb.lower.cuda_sm90.kbargs_struct (natural C layout)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("q_stride", ctypes.c_longlong * 4), ("k_stride", ctypes.c_longlong * 4),
        ("v_stride", ctypes.c_longlong * 4), ("o_stride", ctypes.c_longlong * 4),
        ("lse_stride", ctypes.c_longlong * 3),
        ("B", ctypes.c_longlong), ("Hq", ctypes.c_longlong), ("Hkv", ctypes.c_longlong),
        ("M", ctypes.c_longlong), ("N", ctypes.c_longlong), ("D", ctypes.c_longlong),
        ("sm_scale", ctypes.c_float),
    ]


@dataclass(frozen=True)
class Variant:
    schedule: str
    mask: str
    head_dim: int

    @property
    def name(self) -> str:
        return f"{self.schedule}/{self.mask}/D{self.head_dim}"


@dataclass
class Report:
    builds: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    timings: list = field(default_factory=list)
    failures: list = field(default_factory=list)
    bad_schedules: set = field(default_factory=set)  # a failed check leaves the schedule out of the timing


class Sm90Lib:
    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.kb_sm90_launch.argtypes = [ctypes.POINTER(KbArgs), ctypes.c_void_p]
        self.lib.kb_sm90_launch.restype = ctypes.c_int
        self.lib.kb_sm90_error_string.argtypes = [ctypes.c_int]
        self.lib.kb_sm90_error_string.restype = ctypes.c_char_p

    def launch(self, q, k, v, o, lse, scale: float) -> None:
        # q, o: [B, Hq, M, D]; k, v: [B, Hkv, N, D]; lse: [B, Hq, M] fp32
        a = KbArgs()
        a.q, a.k, a.v, a.o, a.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr()
        for name, t in (("q_stride", q), ("k_stride", k), ("v_stride", v), ("o_stride", o), ("lse_stride", lse)):
            getattr(a, name)[:] = list(t.stride())
        a.B, a.Hq, a.M, a.D = q.shape
        a.Hkv, a.N = k.shape[1], k.shape[2]
        a.sm_scale = scale
        self._keep = a
        rc = self.lib.kb_sm90_launch(ctypes.byref(a), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if rc != 0:
            raise RuntimeError(f"kb_sm90_launch returned {rc}: {self.lib.kb_sm90_error_string(rc).decode()}")


def build_all(variants: list[Variant], out_dir: Path, jobs: int) -> dict[Variant, Path | None]:
    def one(var: Variant):
        overlap, pingpong = SCHEDULES[var.schedule]
        src = sm90_forward_source(HOOKS[var.mask](), head_dim_pad=var.head_dim, block_m=128, block_n=128,
                                  overlap=overlap, pingpong=pingpong)
        return var, build(src, out_dir, BuildMode.SHARED, name=f"sm90_{var.schedule}_{var.mask}_{var.head_dim}",
                          arch=SM90_ARCH, extra_flags=("-Xptxas", "-v"))

    libs: dict[Variant, Path | None] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for var, res in pool.map(one, variants):
            if res.ok:
                ptxas = " | ".join(ln.strip() for ln in res.log.splitlines() if "Used" in ln or "spill" in ln)
                print(f"build {var.name}: ok ({res.seconds:.1f} s{', cached' if res.cached else ''}) {ptxas}")
                libs[var] = res.artefact
            else:
                print(f"build {var.name}: {res.status.value}\n{res.log}\n")
                libs[var] = None
    return libs


def reference(q, k, v, causal: bool, scale: float):
    """fp32 o and lse from the same 16-bit inputs; rows with no visible key give o = 0, lse = -inf."""
    rep = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, H, M, N]
    if causal:
        m, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.matmul(p, vf), lse


def make_inputs(B, Hq, Hkv, M, N, D, layout: str, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(h, L):
        if layout == "bshd":  # [B, L, H, D] storage seen as [B, H, L, D]: non-contiguous, TMA-legal strides
            return torch.randn(B, L, h, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
        return torch.randn(B, h, L, D, device="cuda", generator=g).to(torch.bfloat16)

    return rnd(Hq, M), rnd(Hkv, N), rnd(Hkv, N)


def wait_or_die(hang_s: float, what: str, report: Report, json_path: Path | None) -> None:
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > hang_s:
            msg = f"HANG: {what} did not finish in {hang_s:.0f} s (deadlock in the mbarrier/named-barrier protocol?)"
            print(msg, flush=True)
            report.failures.append(msg)
            write_json(report, json_path)
            os._exit(1)
        time.sleep(0.01)


def describe_bad(o, ref, lse, lse_ref) -> dict:
    err = (o.float() - ref).abs()
    bad = (err > O_TOL) | torch.isnan(o.float())
    lerr = torch.where(torch.isinf(lse_ref) & torch.isinf(lse) & (lse_ref < 0) & (lse < 0),
                       torch.zeros_like(lse), (lse - lse_ref).abs())
    lbad = (lerr > LSE_TOL) | torch.isnan(lse)
    out = {"o_max_err": float(torch.nan_to_num(err, nan=float("inf")).max()),
           "lse_max_err": float(torch.nan_to_num(lerr, nan=float("inf")).max()),
           "o_nan": int(torch.isnan(o.float()).sum()), "lse_nan": int(torch.isnan(lse).sum()),
           "o_bad": int(bad.sum()), "lse_bad": int(lbad.sum()), "o_numel": o.numel()}
    if bad.any():
        idx = bad.nonzero()
        b, h, i, j = (int(x) for x in idx[0])
        out["first_bad"] = {"b": b, "h": h, "row": i, "col": j, "got": float(o[b, h, i, j]),
                            "want": float(ref[b, h, i, j])}
        out["bad_rows_mod128"] = sorted({int(r) % 128 for r in idx[:, 2].unique()[:4096]})[:40]
        out["bad_cols"] = sorted({int(c) for c in idx[:, 3].unique()})[:40]
        out["bad_row_frac"] = float(bad.any(-1).float().mean())
    if lbad.any():
        b, h, i = (int(x) for x in lbad.nonzero()[0])
        out["first_bad_lse"] = {"b": b, "h": h, "row": i, "got": float(lse[b, h, i]), "want": float(lse_ref[b, h, i])}
    return out


def check_case(lib: Sm90Lib, var: Variant, shape: tuple, layout: str, report: Report, args) -> bool:
    B, Hq, Hkv, M, N = shape
    D = var.head_dim
    q, k, v = make_inputs(B, Hq, Hkv, M, N, D, layout)
    scale = 1.0 / math.sqrt(D)
    o = torch.full((B, Hq, M, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((B, Hq, M), float("nan"), device="cuda", dtype=torch.float32)
    tag = f"{var.name} B{B} Hq{Hq} Hkv{Hkv} M{M} N{N} {layout}"
    try:
        lib.launch(q, k, v, o, lse, scale)
    except RuntimeError as err:
        print(f"FAIL {tag}: {err}")
        report.failures.append(f"{tag}: {err}")
        report.checks.append({"case": tag, "ok": False, "error": str(err)})
        return False
    wait_or_die(args.hang_s, tag, report, args.json)
    torch.cuda.synchronize()
    ref, lse_ref = reference(q, k, v, var.mask == "causal", scale)
    info = describe_bad(o, ref, lse, lse_ref)
    ok = info["o_bad"] == 0 and info["lse_bad"] == 0
    print(f"{'PASS' if ok else 'FAIL'} {tag}: o max err {info['o_max_err']:.3g} (nan {info['o_nan']}), "
          f"lse max err {info['lse_max_err']:.3g} (nan {info['lse_nan']})")
    if not ok:
        print("    " + json.dumps({k_: v_ for k_, v_ in info.items() if k_ not in ("o_max_err", "lse_max_err")}))
        report.failures.append(tag)
    report.checks.append({"case": tag, "ok": ok, **info})
    return ok


def time_fn(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sdpa_time(backend_name: str, q, k, v, causal: bool, args) -> float | None:
    backend = getattr(SDPBackend, backend_name)
    try:
        with sdpa_kernel([backend]):
            return time_fn(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), args.warmup, args.reps)
    except Exception as err:  # a backend that refuses this shape is reported, not fatal
        print(f"    sdpa {backend_name}: unavailable ({type(err).__name__}: {str(err)[:120]})")
        return None


def run_timing(libs: dict, report: Report, args) -> None:
    B, H = 2, 16
    for S in (2048, 8192):
        for D in (128, 64):
            for mask in ("causal", "plain"):
                causal = mask == "causal"
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                q, k, v = make_inputs(B, H, H, S, S, D, "bhsd")
                o = torch.empty_like(q)
                lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
                row: dict[str, int | str | float | None] = {"B": B, "H": H, "S": S, "D": D, "mask": mask}
                line = [f"S={S:5d} D={D:3d} {mask:6s}"]
                for var, path in libs.items():
                    if path is None or var.mask != mask or var.head_dim != D or var.schedule in report.bad_schedules:
                        continue
                    lib = Sm90Lib(path)
                    ms = time_fn(lambda: lib.launch(q, k, v, o, lse, 1.0 / math.sqrt(D)), args.warmup, args.reps)
                    wait_or_die(args.hang_s, f"timing {var.name}", report, args.json)
                    row[f"kb_{var.schedule}_ms"] = ms
                    line.append(f"kb/{var.schedule} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TF/s")
                for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                    sdpa_ms = sdpa_time(backend, q, k, v, causal, args)
                    row[f"sdpa_{backend.lower()}_ms"] = sdpa_ms
                    if sdpa_ms is not None:
                        line.append(f"{backend.split('_')[0].lower()} {sdpa_ms:7.3f} ms {flops / sdpa_ms / 1e9:6.1f} TF/s")
                print("  ".join(line), flush=True)
                report.timings.append(row)


def write_json(report: Report, path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(report)
    data["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    path.write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {path}")


def correctness_shapes(mask: str, quick: bool) -> list[tuple[tuple, str]]:
    # (B, Hq, Hkv, M, N), layout; ragged tails (1000, 257), GQA 8/2, M != N for plain
    if mask == "causal":
        quick_set = [((2, 8, 2, 1000, 1000), "bhsd")]
        more = [((1, 2, 2, 128, 128), "bhsd"), ((1, 4, 4, 64, 64), "bhsd"), ((2, 4, 4, 2048, 2048), "bhsd"),
                ((1, 8, 2, 1000, 257), "bhsd"), ((2, 4, 2, 777, 777), "bshd")]
    else:
        quick_set = [((2, 8, 2, 257, 1000), "bhsd")]
        more = [((1, 2, 2, 128, 128), "bhsd"), ((1, 2, 2, 1000, 257), "bhsd"), ((2, 4, 4, 2048, 2048), "bhsd"),
                ((1, 8, 2, 300, 1), "bhsd"), ((2, 4, 2, 777, 513), "bshd")]
    return quick_set if quick else quick_set + more


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one correctness shape per case, no timing")
    ap.add_argument("--schedules", default="serial,pingpong,overlap,fa3",
                    help=f"comma list of {list(SCHEDULES)} (run in that order)")
    ap.add_argument("--build-dir", type=Path, default=Path(os.environ.get("KB_SM90_BUILD", "/tmp/kb_sm90_build")))
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--hang-s", type=float, default=30.0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    args.json = Path(os.environ["OUT"]) / "sm90_check.json" if os.environ.get("OUT") else None
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, error codes {ERROR_CODES}")
    schedules = [s for s in SCHEDULES if s in args.schedules.split(",")]
    variants = [Variant(s, m, d) for s in schedules for m in ("plain", "causal") for d in (128, 64)]
    libs = build_all(variants, args.build_dir, args.jobs)
    report = Report()
    report.builds = {v.name: (str(p) if p else None) for v, p in libs.items()}
    ok = all(p is not None for p in libs.values())
    if not ok:
        report.failures.append("build failure")
    for var, path in libs.items():
        if path is None:
            continue
        lib = Sm90Lib(path)
        for shape, layout in correctness_shapes(var.mask, args.quick):
            if not check_case(lib, var, shape, layout, report, args):
                ok = False
                report.bad_schedules.add(var.schedule)
    if not args.quick:
        run_timing(libs, report, args)
    write_json(report, args.json)
    print("ALL PASS" if ok else f"FAILURES: {len(report.failures)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
