"""A copy of what `kb generate` wrote, with every module's Triton kernels lowered again by this checkout.

An ablation for changes to the kernel lowering alone: each `@triton.jit` kernel of `gen_<spec>.py` and
`gen_<spec>_triton.py` is replaced by the one this checkout lowers from the `.kbir` beside it (`gen_<spec>.kbir`, and
`gen_<spec>_bwd.kbir` for the backward), with the helpers those kernels call; the host code, design tables and `.cu`
dispatch stay as generated. Timing the original directory and the copy (`bench.gpu.tune_bwd --suite ... --from`)
measures the kernel change and nothing else.

    .venv/bin/python -m bench.relower_triton .kbgen/hb34 .kbgen/hb34_onebody
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from kb.ir.design import DesignTable, parse_design
from kb.ir.text import parse_program
from kb.lower.triton import lower_program
from kb.lower.triton_outline import module_names

__all__ = ["jit_blocks", "relower_module", "relowered_copy"]

def jit_blocks(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, line after the last) of each top-level `@triton.jit` function outside the preambles."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line != "@triton.jit":
            continue
        name = re.match(r"def (\w+)\(", lines[i + 1])
        assert name is not None, f"line {i + 2}: a @triton.jit without a def"
        end = i + 2
        while end < len(lines) and (not lines[end] or lines[end][0] in " #)"):
            end += 1
        while not lines[end - 1]:
            end -= 1
        if name.group(1) not in module_names():
            out.append((name.group(1), i, end))
    return out


def _kernel_units(source: str, known: set[str]) -> dict[str, list[str]]:
    """Kernel name -> its lines in `source`, preceded by the helpers (functions not in `known`) written before it."""
    lines = source.splitlines()
    units: dict[str, list[str]] = {}
    helpers: list[str] = []
    for name, start, end in jit_blocks(source):
        if name in known:
            units[name] = helpers + lines[start:end]
            helpers = []
        else:
            helpers += lines[start:end] + ["", ""]
    return units


def relower_module(text: str, sources: list[str]) -> str:
    """`text` (a generated module) with each of its kernels replaced by the same-named one of `sources` (modules
    lowered by this checkout) and the helpers it calls; KeyError naming a kernel no source has."""
    blocks = jit_blocks(text)
    known = {name for name, _, _ in blocks}
    units: dict[str, list[str]] = {}
    for src in sources:
        units.update(_kernel_units(src, known))
    lines = text.splitlines()
    for name, start, end in reversed(blocks):
        if name not in units:
            raise KeyError(f"no lowering of this checkout has kernel {name}")
        lines[start:end] = units[name]
    return "\n".join(lines) + "\n"


def _designs(report: dict) -> DesignTable:
    return {arch: {int(bucket): tuple(parse_design(d) for d in ds) for bucket, ds in by.items()}
            for arch, by in (report.get("designs") or {}).items()}


def relowered_copy(gen_dir: Path, out: Path) -> list[str]:
    """Copy `gen_dir` to `out` with its modules' Triton kernels lowered again; the modules rewritten."""
    shutil.copytree(gen_dir, out)
    done = []
    for kbir in sorted(out.glob("gen_*.kbir")):
        if kbir.stem.endswith("_bwd"):
            continue
        report_path = kbir.with_suffix(".report.json")
        designs = _designs(json.loads(report_path.read_text())) if report_path.exists() else None
        sources = [lower_program(parse_program(kbir.read_text()), designs=designs)]
        bwd = kbir.with_name(kbir.stem + "_bwd.kbir")
        if bwd.exists():
            sources.append(lower_program(parse_program(bwd.read_text())))
        for module in (kbir.with_suffix(".py"), kbir.with_name(kbir.stem + "_triton.py")):
            if module.exists():
                module.write_text(relower_module(module.read_text(), sources))
                done.append(module.name)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gen_dir", type=Path, help="a directory `kb generate --out` wrote")
    ap.add_argument("out", type=Path, help="where the copy goes (must not exist)")
    a = ap.parse_args(argv)
    if a.out.exists():
        print(f"{a.out} exists; give a new directory", file=sys.stderr)
        return 2
    for name in relowered_copy(a.gen_dir, a.out):
        print(f"{name}: kernels lowered again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
