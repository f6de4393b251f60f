"""ptxas registers and spills of the tensor-core CUDA lowering (kb.lower.cuda_mma), on the CPU.

For fixtures x traits x HEAD_PAD x arch it builds the emitted .cu with
`nvcc -std=c++17 -O3 -Xptxas -v -DKB_HEAD_PAD_ONLY=<hp> -c` and prints the forward kernel's
registers, spill stores/loads and stack frame. No GPU needed; it is what to compare before timing.

    PYTHONPATH=. python bench/mma_regs.py
    PYTHONPATH=. python bench/mma_regs.py --fixtures causal,document --traits 128x64x4 --head-pads 128 --archs sm_80
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kb.ir.nodes import Dtype
from kb.lower.cuda_build import find_nvcc
from kb.lower.cuda_mma import MmaTraits, lower_program_mma, with_traits
from tests.support.ir_programs import FIXTURES

ARCHS = {"sm_80": ["-arch=sm_80"], "sm_90a": ["-gencode=arch=compute_90a,code=sm_90a"]}
_FWD = re.compile(r"Compiling entry function '(_Z\w*kb_fwd_kernel\w*)'.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
                  r"(\d+) bytes spill loads.*?Used (\d+) registers", re.S)


def parse_traits(text: str) -> MmaTraits:
    m, n, w = (int(x) for x in text.lower().replace("w", "").split("x"))
    return MmaTraits(m, n, w)


def ptxas_info(nvcc: str, src: str, head_pad: int, arch: str) -> dict:
    """{'regs', 'spill_st', 'spill_ld', 'stack'} of the forward kernel (ptxas -v)."""
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "k.cu"
        cu.write_text(src)
        res = subprocess.run([nvcc, "-std=c++17", *ARCHS[arch], "-O3", "-Xptxas", "-v", f"-DKB_HEAD_PAD_ONLY={head_pad}",
                              "-c", "-o", str(Path(tmp) / "k.o"), str(cu)], capture_output=True, text=True, timeout=600)
    info = res.stdout + res.stderr
    m = _FWD.search(info)
    if res.returncode != 0 or not m:
        raise RuntimeError(f"nvcc failed ({arch}, HEAD_PAD {head_pad}):\n{info[-3000:]}")
    return {"stack": int(m.group(2)), "spill_st": int(m.group(3)), "spill_ld": int(m.group(4)), "regs": int(m.group(5))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", default="causal,plain,alibi,sliding_window,document")
    ap.add_argument("--traits", default="128x64x4,128x64x8")
    ap.add_argument("--head-pads", default="64,128")
    ap.add_argument("--archs", default="sm_80,sm_90a")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args(argv)
    nvcc = find_nvcc()
    dtype = Dtype.BF16 if args.dtype == "bf16" else Dtype.F16
    jobs = []
    for name in args.fixtures.split(","):
        for tr in args.traits.split(","):
            traits = parse_traits(tr)
            src = lower_program_mma(with_traits(FIXTURES[name](dtype=dtype), traits))
            for hp in (int(x) for x in args.head_pads.split(",")):
                for arch in args.archs.split(","):
                    jobs.append((name, tr, hp, arch, src))
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda j: ptxas_info(nvcc, j[4], j[2], j[3]), jobs))
    print(f"{'fixture':<16}{'traits':<11}{'HP':>4}  {'arch':<7}{'regs':>5}{'spill st/ld':>13}{'stack':>7}")
    for (name, tr, hp, arch, _), r in zip(jobs, results):
        print(f"{name:<16}{tr:<11}{hp:>4}  {arch:<7}{r['regs']:>5}{r['spill_st']:>7}/{r['spill_ld']:<5}{r['stack']:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
