"""What compiling a first call's listed designs together saves, on this machine's CPUs (no GPU needed; not a test).

    python -m bench.compile_ahead DIR/gen_SPEC.py [...] [--json]      # files kb generate wrote (their reports name the spec)

A generated module's first call on a listed GPU compiles every listed design's kernels, then tries and times them
(`_compile_designs`, `_timed_choice` in kb/lower/triton_preamble.py). This times only the compiling, for sm_90: each
module runs in a fresh process with an empty Triton cache and a stand-in for Triton's CUDA driver that names an
sm_90 target, so Triton's real front end, MLIR passes, LLVM and ptxas build the kernels of every listed design while
nothing is launched (`_fits` and `_timings` are stubbed; the call stops at the first launch). Two rows per module and
pass (forward, backward): `one by one` (the designs compiled in a loop, as before) and `together` (as shipped: threads
under Triton's AsyncCompileMode). ModelNew runs on the spec's own small CPU inputs (its aux tensors and state as a user passes
them; the kernels' dtypes, head dims and alignment are the bench shape's); the backward row calls backward() with
the forward's arguments. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kb.lower.runtime import import_file


class _Sm90:
    """What JITFunction.run asks of Triton's driver before it compiles, for an sm_90 target; a launch fails (no
    launcher_cls), which is where the timing stops."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget  # noqa: PLC0415  the child only: the parent needs no Triton

        return GPUTarget("cuda", 90, 32)


class _Stop(Exception):
    """Raised by the recording forward of a backward row: the forward's arguments are all it needs."""


def child(gen_path: str, spec_path: str, together: bool, what: str) -> str:
    """One row's first call in this process (its Triton cache empty): '<seconds> <designs listed> <head dim>'."""
    import triton  # noqa: PLC0415  the child only
    from triton.runtime import driver  # noqa: PLC0415

    driver.set_active(_Sm90())  # a stand-in: compiles for sm_90, launches nothing
    mod: Any = import_file(Path(gen_path), "compile_ahead_module")  # a generated module: its helpers are stubbed
    spec = import_file(Path(spec_path), "compile_ahead_spec")
    mod._interpreting = lambda t: False
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: "sm_90 stand-in"
    mod._fits = lambda design, launch, program: True
    mod._timings = lambda designs, launch: [(1.0 + i, x) for i, x in enumerate(designs)]
    mod._keep_choice = lambda *a: None
    if not together:
        def one_by_one(designs: list, launch: Any, program: str) -> None:
            token = mod._COMPILE_ONLY.set(True)
            try:
                for x in designs:
                    launch(x)
            finally:
                mod._COMPILE_ONLY.reset(token)
        mod._compile_designs = one_by_one
    init = list(spec.get_init_inputs())
    model, new = spec.Model(*init), mod.ModelNew(*init)
    new.load_state_dict(model.state_dict())
    inputs = list(spec.get_inputs())
    seen: dict[str, Any] = {}
    forward = mod.forward

    def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        seen.update(q=q, k=k, v=v, kw=kw)  # the forward's tensors and aux as ModelNew passes them
        if what == "backward":
            raise _Stop
        return forward(q, k, v, **kw)

    def run() -> None:
        try:
            new(*inputs)
        except _Stop:
            pass
        if what == "backward":
            q, k, v = seen["q"], seen["k"], seen["v"]
            kw = {n: x for n, x in seen["kw"].items() if not n.startswith("_")}  # forward-only options (_o32)
            o = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
            mod.backward(q, k, v, o, torch.randn_like(o), torch.zeros(q.shape[:-1]), **kw)

    mod.forward = recorded
    start = time.perf_counter()
    try:
        run()
    except Exception as err:  # the first launch after the choice: no GPU here; anything else is this bench's failure
        if "launcher_cls" not in str(err):
            raise
    seconds = time.perf_counter() - start
    table, picked = (mod.DESIGNS, mod._PICKED) if what == "forward" else (mod.BWD_DESIGNS, mod._BWD_PICKED)
    if not picked:  # stopped at a launch before the choice (a block table built on the GPU): nothing to compare
        raise SystemExit("the call launches a kernel before it chooses a design (a block table built on the GPU)")
    d = seen["q"].shape[-1]
    return f"{seconds} {len(table.get('sm90', {}).get(max(16, triton.next_power_of_2(d)), ()))} {d}"




class _NotMeasured(Exception):
    """A module this bench cannot time (the child's last line says why)."""


def _time(gen: Path, spec: Path, together: bool, what: str) -> tuple[float, int, int]:
    """(seconds, designs listed, head dim) of one pass's first call in a fresh process with an empty Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        done = subprocess.run([sys.executable, "-m", "bench.compile_ahead", "--child", str(gen), str(spec),
                               "together" if together else "one", what], env=env, capture_output=True, text=True,
                              check=False)
    if done.returncode != 0:
        raise _NotMeasured((done.stderr.strip().splitlines() or ["?"])[-1])
    seconds, designs, d = done.stdout.split()[-3:]
    return float(seconds), int(designs), int(d)


def _spec_of(gen: Path) -> Path:
    """The spec file kb generate wrote `gen` for (its report, next to it, names it)."""
    report = gen.with_name(gen.stem + ".report.json")
    spec = Path(json.loads(report.read_text())["spec"]) if report.is_file() else None
    if spec is None or not spec.is_file():
        raise SystemExit(f"error: {gen.name}: no report naming its spec next to it (give kb generate's --out files)")
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="*", type=Path, help="generated gen_SPEC.py files (kb generate --out DIR)")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    ap.add_argument("--child", nargs=4, metavar=("GEN", "SPEC", "MODE", "PASS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        gen, spec, mode, what = args.child
        print(child(gen, spec, mode == "together", what))
        return
    if not args.modules:
        ap.error("give at least one generated gen_SPEC.py")
    rows = []
    for path in args.modules:
        if not path.is_file():
            ap.error(f"no such module: {path}")
        spec = _spec_of(path)
        for what in ("forward", "backward"):
            try:
                (one, n, d), (together, _, _) = _time(path, spec, False, what), _time(path, spec, True, what)
            except _NotMeasured as err:
                rows.append({"module": path.name, "pass": what, "not_measured": str(err)})
                print(f"{path.name:36s} {what:8s} not measured: {err}", file=sys.stderr, flush=True)
                continue
            rows.append({"module": path.name, "pass": what, "D": d, "designs": n, "one_by_one_s": round(one, 2),
                         "together_s": round(together, 2), "cpus": os.cpu_count()})
            if not args.json:
                print(f"{path.name:36s} {what:8s} D={d:<4d} {n} designs: one by one {one:6.2f} s, "
                      f"together {together:6.2f} s ({one / together:.2f}x) on {os.cpu_count()} CPUs", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
