"""Does a change to the Triton lowering change the machine code? Compile both versions' kernels for sm_90 and compare.

For each `.kbir` program, the module is lowered by this checkout and by `--base-tree` (a checkout of another commit,
lowering in a child process with that tree first on the path), every kernel of both is compiled by Triton's own
compiler and ptxas for sm_90 (no GPU; kb.lower.triton_aot) at the program's schedule, with and without tensor
descriptors (and a backward's split query loop), and the SASS is compared instruction by instruction, operands
included (addresses, encodings and line info left out), as are the Triton IR's operations in order. Equal SASS is
equal machine code: a refactor of the emitted source (the one-body split loops) then cannot have moved the kernel's
speed. Equal Triton IR operations with unequal SASS means the same program whose values were numbered in another
order (constants made in another order, say), which can move ptxas's register allocation a little.

    git worktree add /tmp/base <rev>
    .venv/bin/python -m bench.sass_identity --base-tree /tmp/base --out bench/results/sass_identity.json DIR/*.kbir
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from kb.errors import KBError
from kb.ir.nodes import VALUE_DIM
from kb.ir.text import parse_program
from kb.lower.triton import lower_program
from kb.lower.triton_aot import compile_for_arch

_LOWER = ("import sys; from kb.ir.text import parse_program; from kb.lower.triton import lower_program; "
          "sys.stdout.write(lower_program(parse_program(open(sys.argv[1]).read())))")


def base_source(tree: Path, kbir: Path) -> str:
    """The module `tree`'s lowering makes of `kbir`."""
    done = subprocess.run([sys.executable, "-c", _LOWER, str(kbir.resolve())], cwd=tree, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{kbir}: the base tree's lowering failed:\n{done.stderr[-2000:]}")
    return done.stdout


def compare(kbir: Path, tree: Path) -> list[dict]:
    p = parse_program(kbir.read_text())
    sources = {"base": base_source(tree, kbir), "head": lower_program(p)}
    rows = []
    dims = p.dims()
    variants = [(False, False), (True, False)] + ([(False, True)] if "SPLIT_Q" in sources["head"] else [])
    for tma, split_q in variants:
        kernels = {name: compile_for_arch(p, tma=tma, split_q=split_q, source=src,
                                          head_dim_v=128 if VALUE_DIM in dims else None) for name, src in sources.items()}
        for base, head in zip(kernels["base"], kernels["head"]):
            rows.append({"program": p.name, "kernel": head.name, "tma": tma, "split_q": split_q,
                         "same_ttir_ops": base.ttir_ops_digest == head.ttir_ops_digest,
                         "same_sass": base.sass_digest == head.sass_digest,
                         "base": dataclasses.asdict(base), "head": dataclasses.asdict(head)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kbir", nargs="+", type=Path, help="IR programs (.kbir) to lower both ways")
    ap.add_argument("--base-tree", type=Path, required=True, help="a checkout of the lowering to compare against")
    ap.add_argument("--out", type=Path, required=True, help="JSON file of the comparison")
    args = ap.parse_args(argv)
    base_rev = subprocess.run(["git", "-C", str(args.base_tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    head_rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip())
    rows: list[dict] = []
    for kbir in args.kbir:
        start = time.perf_counter()
        try:
            mine = compare(kbir, args.base_tree)
        except KBError as err:  # a compile either version fails: said, and the others still compared
            print(f"{kbir.name}: not compared: {err}", flush=True)
            continue
        rows += mine
        print(f"{kbir.name}: Triton IR ops the same in {sum(r['same_ttir_ops'] for r in mine)} of {len(mine)} compiles, "
              f"SASS in {sum(r['same_sass'] for r in mine)} ({time.perf_counter() - start:.0f} s)", flush=True)
        args.out.write_text(json.dumps({"base": base_rev, "head": head_rev, "head_dirty": dirty, "arch": "sm_90",
                                        "date": time.strftime("%Y-%m-%d"), "kernels": rows}, indent=1) + "\n")
    print(f"of {len(rows)} kernel compiles: the same Triton IR ops in {sum(r['same_ttir_ops'] for r in rows)}, "
          f"the same SASS in {sum(r['same_sass'] for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
