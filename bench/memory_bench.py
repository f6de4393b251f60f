"""Continual improvement: generate a sequence of specs with write-back memory on vs off.

Both modes start from the same ingested KB (copied), run the same specs in the same order
with the rule engine, and differ only in `GenerateOptions.memory` (off = retrieval ignores
generated kernels and lessons). Prints success rate, attempts to success and time per spec.

    .venv/bin/python bench/memory_bench.py [--specs DIR_OR_FILES...] [--out bench/results/memory.json]

Not a test: it runs the verifier on every generated kernel (Triton interpreter on CPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from generate.pipeline import GenerateOptions, generate  # noqa: E402
from ingest.run import ingest  # noqa: E402
from kb.settings import load_settings  # noqa: E402
from kb.store.kb import open_kb  # noqa: E402

# Related variants follow each other, as a user's task stream would: the question is
# whether what was learnt on the first of a kind makes the next one cheaper.
DEFAULT_SEQUENCE = [
    "tests/data/specs/causal_where_d128.py",
    "examples/specs/chunked_prefill_bottom_right.py",
    "tests/data/specs/chunked_prefill_causal.py",
    "tests/data/specs/sliding_window_32.py",
    "examples/specs/sliding_window.py",
    "tests/data/specs/document_packed.py",
    "examples/specs/document_mask.py",
    "tests/data/specs/alibi_causal.py",
    "examples/specs/alibi.py",
    "examples/specs/decode_gqa_splitkv.py",
]


def run_mode(base_home: Path, specs: list[Path], memory: bool, out_dir: Path) -> list[dict]:
    home = Path(tempfile.mkdtemp(prefix=f"kb-mem-{'on' if memory else 'off'}-"))
    shutil.copytree(base_home, home, dirs_exist_ok=True)
    kb = open_kb(load_settings(home=str(home)))
    rows = []
    opts = GenerateOptions(memory=memory, out_dir=out_dir / ("on" if memory else "off"),
                           verify_distributions=("normal",), verify_max_cases=1)
    for spec in specs:
        t0 = time.perf_counter()
        r = generate(kb, spec, opts)
        rows.append({"spec": str(spec), "succeeded": r.succeeded, "attempts": len(r.attempts),
                     "strategies": [a.strategy for a in r.attempts], "seconds": round(time.perf_counter() - t0, 1),
                     "error": r.error[:200]})
        print(f"memory={'on ' if memory else 'off'} {spec.name:32s} {'ok' if r.succeeded else 'FAIL'} "
              f"attempts={len(r.attempts)} {rows[-1]['seconds']}s", flush=True)
    kb.close()
    return rows


def summarise(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["succeeded"]]
    half = len(rows) // 2
    later = [r for r in rows[half:] if r["succeeded"]]
    return {"success_rate": len(ok) / max(1, len(rows)),
            "mean_attempts_to_success": sum(r["attempts"] for r in ok) / max(1, len(ok)),
            "mean_attempts_later_half": sum(r["attempts"] for r in later) / max(1, len(later)),
            "total_attempts": sum(r["attempts"] for r in rows),
            "seconds": round(sum(r["seconds"] for r in rows), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--specs", nargs="*", default=DEFAULT_SEQUENCE)
    ap.add_argument("--sources", nargs="*", default=["flash-attn-2"])
    ap.add_argument("--out", default="bench/results/memory.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    specs = [ROOT / s for s in args.specs]
    base = Path(tempfile.mkdtemp(prefix="kb-mem-base-"))
    kb = open_kb(load_settings(home=str(base)))
    ingest(kb, args.sources, progress=False)
    kb.close()
    out_dir = Path(tempfile.mkdtemp(prefix="kb-mem-out-"))
    result = {"sequence": args.specs, "off": run_mode(base, specs, False, out_dir), "on": run_mode(base, specs, True, out_dir)}
    result["summary"] = {"off": summarise(result["off"]), "on": summarise(result["on"])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\n{'mode':6s} {'success':>8s} {'attempts/success':>17s} {'later half':>11s} {'total attempts':>15s} {'seconds':>8s}")
    for mode in ("off", "on"):
        s = result["summary"][mode]
        print(f"{mode:6s} {s['success_rate']:8.2f} {s['mean_attempts_to_success']:17.2f} {s['mean_attempts_later_half']:11.2f} "
              f"{s['total_attempts']:15d} {s['seconds']:8.1f}")


if __name__ == "__main__":
    main()
