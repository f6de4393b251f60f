"""What compiling a first call's listed designs together saves, on this machine's CPUs (no GPU needed; not a test).

    python -m bench.compile_ahead GEN_MODULE_triton.py [...] [--json]

A generated module's first call on a listed GPU compiles every listed design's kernels, then tries and times them
(`_compile_designs`, `_timed_choice` in kb/lower/triton_preamble.py). This times only the compiling, for sm_90: each
module runs in a fresh process with an empty Triton cache and a stand-in for Triton's CUDA driver that names an
sm_90 target, so Triton's real front end, MLIR passes, LLVM and ptxas build the kernels of every listed design while
nothing is launched (`_fits` and `_timings` are stubbed; the call stops at the first launch). Two rows per module and
pass (forward, backward): `one by one` (the designs compiled in a loop, as before) and `together` (as shipped: threads
under Triton's AsyncCompileMode). Small CPU tensors stand for the inputs; the kernels' specialisations (dtypes, head
dims, 16-byte alignment) are those of a bf16 call at the spec's BENCH head dims. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kb.lower.runtime import import_file

_CHILD = r"""
import os, sys, time, torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class _Sm90:  # what JITFunction.run asks of the driver before it compiles; a launch fails (no launcher_cls)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)


driver.set_active(_Sm90())
from kb.lower.runtime import import_file
path, together, what, d, dv = sys.argv[1], sys.argv[2] == "together", sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
mod = import_file(path, "compile_ahead_module")
mod._interpreting = lambda t: False
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.get_device_name = lambda device=None: "sm_90 stand-in"
mod._fits = lambda design, launch, program: True
mod._timings = lambda designs, launch: [(1.0 + i, x) for i, x in enumerate(designs)]
mod._keep_choice = lambda *a: None
if not together:
    def one_by_one(designs, launch, program):
        mod._COMPILE_ONLY[0] = True
        try:
            for x in designs:
                launch(x)
        finally:
            mod._COMPILE_ONLY[0] = False
    mod._compile_designs = one_by_one
q, k, v, o, do = (torch.randn(1, 2, 256, n, dtype=torch.bfloat16) for n in (d, d, dv, dv, dv))
start = time.perf_counter()
try:
    mod.forward(q, k, v) if what == "forward" else mod.backward(q, k, v, o, do, torch.zeros(1, 2, 256))
except Exception:
    pass  # the first launch after the choice: no GPU here
seconds = time.perf_counter() - start
table = mod.DESIGNS if what == "forward" else mod.BWD_DESIGNS
print(seconds, len(table.get("sm90", {}).get(max(16, triton.next_power_of_2(d)), ())))
"""


def _time(path: Path, together: bool, what: str, d: int, dv: int) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        done = subprocess.run([sys.executable, "-c", _CHILD, str(path), "together" if together else "one", what, str(d),
                               str(dv)],
                              env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"error: {path.name} {what}: {done.stderr.strip().splitlines()[-1:]}")
    seconds, designs = done.stdout.split()[-2:]
    return float(seconds), int(designs)


def _head_dims(path: Path) -> tuple[int, int]:
    """(D, D_v) of the spec the module was generated for (its report names the spec file; its BENCH the shape)."""
    report = path.with_name(path.name.replace("_triton.py", ".report.json"))
    spec = Path(json.loads(report.read_text())["spec"]) if report.is_file() else None
    if spec is None or not spec.is_file():
        raise SystemExit(f"error: {path.name}: no report naming its spec next to it (give kb generate's --out files)")
    bench = import_file(spec, f"spec_{spec.stem}").BENCH
    return int(bench["D"]), int(bench.get("Dv", bench["D"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="+", type=Path, help="generated *_triton.py files (kb generate --out DIR)")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    args = ap.parse_args()
    rows = []
    for path in args.modules:
        if not path.is_file():
            ap.error(f"no such module: {path}")
        d, dv = _head_dims(path)
        for what in ("forward", "backward"):
            (one, n), (together, _) = _time(path, False, what, d, dv), _time(path, True, what, d, dv)
            rows.append({"module": path.name, "pass": what, "D": d, "designs": n, "one_by_one_s": round(one, 2),
                         "together_s": round(together, 2), "cpus": os.cpu_count()})
            if not args.json:
                print(f"{path.name:42s} {what:8s} D={d:<4d} {n} designs: one by one {one:6.2f} s, "
                      f"together {together:6.2f} s ({one / together:.2f}x) on {os.cpu_count()} CPUs", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
