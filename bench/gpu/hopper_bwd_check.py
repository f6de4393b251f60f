"""The `.cu` Hopper backward of generated modules beside their Triton backward, one training step each (an ablation).

    python -m bench.gpu.hopper_bwd_check OUT.json GEN_DIR SPEC.py [SPEC.py ...] [--trials N]

`--relower`: first re-lower each `.cu` that holds the Hopper backward with this checkout's lowering into a copy of
GEN_DIR (its `.kbir` beside it), and time that copy: the kernel as `kb generate` would write it now.

For each spec: at its own small shape (ragged sequence lengths) and at its bench shapes, `ModelNew` as `kb generate`
wrote it into GEN_DIR (`emitted`) and the same step with the `.cu`'s backward forced (`emitted-cuda-bwd`,
bench.gpu.tune_bwd), each checked against the spec's own autograd and timed. Measures only; what generation uses
comes from `kb perf import` of a `tune_bwd` run.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu import tune_common as common
from bench.gpu.tune_bwd import _cuda_backward_records, _prepare_step, bwd_record, cuda_backward_forced
from kb.ir.text import parse_program
from kb.lower.cuda_sm90_bwd import BWD_PAD_Q
from kb.lower.cuda_sm90_ir import lower_program_sm90


def _profile(impl, dout) -> str:
    """The GPU kernels of three training steps, by total time (torch.profiler)."""
    out = impl.call()
    out.backward(dout)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            out = impl.call()
            out.backward(dout)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60)


def _check(spec_path: str, gen_dir: Path, trials: int, idx: int, small: bool, check: bool, prof: bool) -> list[dict]:
    spec = common.load_file(spec_path, f"kb_hbc_spec_{idx}")
    entry = {"spec": spec_path, "candidate": str(gen_dir / f"gen_{Path(spec_path).stem}.py")}
    rows = []
    for j, shape in enumerate([{}] * small + common.bench_shapes(spec, None)):
        st = _prepare_step(entry, spec, shape, f"hbc{idx}_{j}", "cuda")
        em, dims, flops = st.em, st.dims, st.flops_fwd + st.flops_bwd
        recs = [bwd_record("emitted", em.impl, st.ref, flops, trials),
                *_cuda_backward_records(em, st.ref, flops, trials, "cuda", check)]
        if prof and shape:
            print(_profile(em.impl, st.dout.to(st.inputs[0].dtype)), flush=True)
            with cuda_backward_forced(em.module):
                print(_profile(em.impl, st.dout.to(st.inputs[0].dtype)), flush=True)
        rows.append({"spec": spec_path, "shape": dims, "records": recs})
        for r in recs:
            print(f"{Path(spec_path).stem:28s} {str(dims):70s} {r['impl']:18s} {r['status']:9s} "
                  f"{r.get('ms', float('nan')):8.3f} ms  grad_err {r.get('grad_err')} {r.get('error', '')[:200]}",
                  flush=True)
    return rows


def _relowered_copy(gen_dir: Path, out: Path | None = None) -> Path:
    """GEN_DIR copied (to `out`, else a temporary directory) with each Hopper-backward `.cu` lowered again from its
    `.kbir`, and its modules' scratch padding for the backward (`CUDA_BWD_PAD_Q`, once `CUDA_BWD_BLOCK_Q`) set to
    what that lowering needs."""
    out = out or Path(tempfile.mkdtemp(prefix="hbc_relower_")) / gen_dir.name
    shutil.copytree(gen_dir, out)
    for cu in sorted(out.glob("*.cu")):
        text = cu.read_text()
        head = re.search(r"#define KB_HEAD_DIM (\d+)", text)
        if "kb_launch_bwd" in text and head:
            program = parse_program(cu.with_suffix(".kbir").read_text())
            cu.write_text(lower_program_sm90(program, int(head.group(1)), backward=True))
            for module in out.glob(f"{cu.stem}*.py"):
                # one name for the padding (modules older than the rename say CUDA_BWD_BLOCK_Q in some places)
                text = module.read_text().replace("CUDA_BWD_BLOCK_Q", "CUDA_BWD_PAD_Q")
                module.write_text(re.sub(r"(?m)^CUDA_BWD_PAD_Q = \d+", f"CUDA_BWD_PAD_Q = {BWD_PAD_Q}", text))
            print(f"{cu.name}: re-lowered", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("gen_dir", type=Path)
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--no-small", action="store_true", help="only the bench shapes")
    ap.add_argument("--no-check", action="store_true", help="time the `.cu` backward whatever its gradients (ablations)")
    ap.add_argument("--profile", action="store_true", help="print each bench shape's GPU kernels (torch.profiler)")
    ap.add_argument("--relower", action="store_true", help="time a copy whose backward `.cu` is lowered again by this checkout")
    a = ap.parse_args(argv)
    if a.relower:
        a.gen_dir = _relowered_copy(a.gen_dir)
    rows = []
    for i, s in enumerate(a.specs):
        try:
            rows += _check(s, a.gen_dir, a.trials, i, not a.no_small, not a.no_check, a.profile)
        except Exception as err:  # one spec's failure is reported, the others still run
            rows.append({"spec": s, "error": f"{type(err).__name__}: {str(err)[:500]}"})
            print(f"{s}: {rows[-1]['error']}", flush=True)
        a.out.write_text(json.dumps({"environment": common.environment(" ".join(sys.argv)), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
